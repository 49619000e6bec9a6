"""Instructions `ferry train-draft` has the model answer, to learn from its own answers
(self-distillation): everyday chat tasks, every template over every topic. None of them is a
prompt `ferry bench spec` measures (ferry/bench/spec_workloads.py), so its acceptance figures
are on text the heads never saw."""

from __future__ import annotations

_TEMPLATES = (
    "Explain {topic} in simple words.",
    "Write a short story that involves {topic}.",
    "List five interesting facts about {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a friendly email to a colleague about {topic}.",
    "Give me step-by-step advice for someone new to {topic}.",
    "Write a short poem about {topic}.",
    "Summarize the history of {topic} in a few paragraphs.",
    "What questions do people often ask about {topic}? Answer three of them.",
    "Describe a typical day for someone who works with {topic}.",
)

_TOPICS = (
    "gardening", "volcanoes", "learning a second language", "electric cars", "honeybees", "the moon landing",
    "baking bread", "public libraries", "chess", "rainforests", "saving money", "the human heart",
    "solar panels", "jazz music", "running a marathon", "ancient Rome", "recycling", "the ocean tides",
    "photography", "coffee", "train travel", "earthquakes", "writing a résumé", "penguins", "video games",
    "the printing press", "yoga", "city parks", "the water cycle", "friendship", "bicycles", "thunderstorms",
    "a small bakery", "space telescopes", "board games", "vaccines", "the Silk Road", "houseplants",
    "remote work", "dinosaurs",
)  # fmt: skip

# Every topic once before any twice, each with another template: the first N prompts are as varied as N allows.
PROMPTS = [
    _TEMPLATES[(j + k) % len(_TEMPLATES)].format(topic=topic)
    for k in range(len(_TEMPLATES))
    for j, topic in enumerate(_TOPICS)
]
