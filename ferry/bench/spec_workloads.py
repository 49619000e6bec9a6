"""The prompts `ferry bench spec` runs: editing tasks whose answers copy much of the prompt (the
case prompt lookup is for), open-ended chat, whose answers do not, and editing tasks the bundled
model does not carry out (so its answers copy little). Shipped with ferry, so every run and every
machine measures the same text."""

from __future__ import annotations

_CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """Total length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''

_CONFIG = """server:
  host: 0.0.0.0
  port: 8080
  workers: 4
  timeout_seconds: 30
database:
  url: postgres://db.internal:5432/app
  pool_size: 10
  pool_timeout_seconds: 5
cache:
  backend: redis
  url: redis://cache.internal:6379/0
  ttl_seconds: 600
logging:
  level: info
  format: json
"""

_PROSE = (
    "The river rose slowly through the night. By morning the lower fields were under water, and the "
    "farmers who had stayed gathered on the bridge to watch it. Nobody spoke much. The old miller said "
    "he had seen it worse in his youth, when the water reached the church steps, but the younger men "
    "did not believe him. At noon the rain stopped, the clouds broke apart, and for the first time in "
    "a week the sun lit the valley. The water began to fall."
)

_SHOP = (
    "Maria opened the shop at seven, as she did every day. She swept the floor, counted the coins in the drawer "
    "and put the fresh bread on the shelves. The first customer was the postman, who bought two rolls and a "
    "newspaper. Later a group of children came in to buy sweets on their way to school. In the afternoon it was "
    "quiet, so Maria read a book behind the counter until closing time."
)

_DIARY = (
    "I woke up early and made coffee. I walked to the station in the rain and took the eight o'clock train. At "
    "work I answered emails until lunch, then I met my sister at the cafe on the corner. In the evening I cooked "
    "pasta and watched a film before bed."
)

_EMAIL = (
    "Hi team,\n\nThe quarterly review is moved from Thursday to Friday at 10am in room 4B. Please bring your "
    "project updates and the budget numbers for the next quarter. Lunch will be provided after the meeting. If "
    "you cannot attend, send your update to Anna by Thursday evening.\n\nThanks,\nTom"
)

# Edits whose answer (from the bundled SmolLM2-135M, greedy) copies most of the prompt: the case
# prompt lookup is for. `copied_share` in the bench's output says how much each answer copies.
EDIT_PROMPTS = [
    "Rewrite this passage in the present tense. Keep everything else the same.\n\n" + _PROSE,
    "Replace the name Maria with Elena in this passage. Output only the updated passage.\n\n" + _SHOP,
    "Rewrite this passage in the third person, using 'he' instead of 'I'.\n\n" + _DIARY,
    "Here is a YAML file. Output the same YAML file with the server port changed to 9090.\n\n" + _CONFIG,
    "Change the day of the meeting in this email from Friday to Monday. Output the full updated email.\n\n" + _EMAIL,
]

# Edits of code and config that the 135M model does not carry out (it writes other code, or JSON):
# its answers copy a third of the prompt or less. Kept to show what drafts buy then.
EDIT_UNFOLLOWED_PROMPTS = [
    "Rename the function merge_intervals to merge_ranges everywhere in this Python code. "
    "Output only the full updated code.\n\n" + _CODE,
    "In this YAML file, change the server port to 9090 and the cache ttl_seconds to 300. "
    "Output only the full updated file.\n\n" + _CONFIG,
]

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
]

WORKLOADS = {"edit": EDIT_PROMPTS, "chat": CHAT_PROMPTS, "edit-unfollowed": EDIT_UNFOLLOWED_PROMPTS}
