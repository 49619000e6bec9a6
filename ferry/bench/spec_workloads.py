"""The prompts `ferry bench spec` runs: editing tasks, whose answers copy much of the prompt (the
case prompt lookup is for), and open-ended chat, whose answers do not. Shipped with ferry, so
every run and every machine measures the same text."""

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

EDIT_PROMPTS = [
    "Rename the function merge_intervals to merge_ranges everywhere in this Python code. "
    "Output only the full updated code.\n\n" + _CODE,
    "In this YAML file, change the server port to 9090 and the cache ttl_seconds to 300. "
    "Output only the full updated file.\n\n" + _CONFIG,
    "Rewrite this passage in the present tense. Keep everything else the same.\n\n" + _PROSE,
]

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
]

WORKLOADS = {"edit": EDIT_PROMPTS, "chat": CHAT_PROMPTS}
