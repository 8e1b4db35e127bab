"""Writes the chat prompts the default EAGLE drafter is self-distilled on (train) and measured on
(held out): templates x topics, deterministic, no downloads. Held-out prompts use topics and
templates that never occur in the training set.

    python benchmarks/drafter/make_prompts.py
    # -> benchmarks/drafter/train_prompts.jsonl, benchmarks/drafter/heldout_prompts.jsonl
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path


def _items(text: str) -> list[str]:
    """The ';'-separated entries of `text`, stripped."""
    return [item.strip() for item in text.split(";") if item.strip()]


TOPICS = _items(
    """photosynthesis; black holes; the French Revolution; climate change; machine learning;
the water cycle; volcanoes; the Roman Empire; vaccines; electric cars; the stock market;
honey bees; the Internet; plate tectonics; the human heart; recycling; the Moon landing;
coffee; chess; the Great Wall of China; solar panels; DNA; earthquakes; the printing press;
rainforests; the immune system; cryptocurrency; the Olympic Games; jazz music;
quantum computing; dinosaurs; the periodic table; democracy; the Renaissance; ocean tides;
sleep; bread baking; gravity; the Amazon river; renewable energy; artificial intelligence;
the Silk Road; penguins; rainbows; the Industrial Revolution; nutrition; meditation;
the solar system; antibiotics; compound interest; public libraries; the Eiffel Tower;
social media; glaciers; the theory of evolution; robots; wind turbines; ancient Egypt;
photography; the speed of light; time management; the Cold War; coral reefs;
healthy breakfasts; the Python programming language; sorting algorithms; databases;
linked lists; recursion; the HTTP protocol; version control with git; unit testing; JSON;
regular expressions; binary numbers; prime numbers; the Pythagorean theorem; fractions;
probability; the metric system; World War I; Shakespeare; the Mona Lisa; mountains; deserts;
friendship; learning a new language; job interviews; saving money; exercise; gardening;
the history of tea; pizza; elephants; sharks; butterflies; thunderstorms; snowflakes;
airplanes; trains; bicycles; the moon; Mars; stars; the sun; electricity; magnets; batteries"""
)

HELD_OUT_TOPICS = _items(
    """lighthouses; origami; the Sahara desert; owls; the violin; submarines; bamboo; the Aztecs;
hot air balloons; spreadsheets; hash tables; the TCP handshake; kangaroos; tsunamis; chocolate;
the Hubble telescope"""
)

TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "What is {t}? Answer in a short paragraph.",
    "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.",
    "Write a short story that involves {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Write a blog post introduction about {t}.",
    "How would you teach a class about {t}? Give a lesson plan.",
    "List five questions a student might ask about {t}, with answers.",
    "Write a Python function related to {t}, with a docstring and an example.",
    "Describe {t} in the style of a news report.",
]

HELD_OUT_TEMPLATES = [
    "Tell me about {t}.",
    "Why is {t} important? Explain step by step.",
    "Write a haiku and then a short explanation about {t}.",
    "Write a Python function related to {t}, and explain how it works.",
]


def main() -> None:
    here = Path(__file__).parent
    topics, held = TOPICS, HELD_OUT_TOPICS
    train = [tpl.format(t=t) for t, tpl in itertools.product(topics, TEMPLATES)]
    # Interleave so that any prefix of the file covers many topics and templates.
    train = [train[(i * 37) % len(train)] for i in range(len(train))]
    heldout = [tpl.format(t=t) for t, tpl in zip(held, itertools.cycle(HELD_OUT_TEMPLATES))]
    for name, prompts in (("train_prompts", train), ("heldout_prompts", heldout)):
        path = here / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"{path}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
