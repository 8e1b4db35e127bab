"""Writes the chat prompts the default EAGLE drafter is self-distilled on (train) and measured on
(held out): templates x topics, deterministic, no downloads. Held-out prompts use topics and
templates that never occur in the training set.

    python benchmarks/drafter/make_prompts.py
    # -> benchmarks/data/train_prompts.jsonl, train_prompts_wide.jsonl, heldout_prompts.jsonl
"""

from __future__ import annotations

import itertools
import json
import math
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

# The wide set (train_prompts_wide.jsonl): more topics and kinds of request, for heads that must
# generalise beyond the topics above (the shipped head, trained on train_prompts.jsonl, accepts
# its first draft 66% of the time on those topics and 52% on held-out ones).
WIDE_TOPICS = _items(
    """volleyball; marathon training; the Beatles; opera; hip hop; ballet; pottery; knitting;
woodworking; beekeeping; composting; houseplants; tomatoes; mushrooms; sourdough; sushi; tacos;
curry; olive oil; cheese making; coffee roasting; tea ceremonies; wine regions; vegetarian diets;
food allergies; first aid; the flu; diabetes; blood pressure; sunscreen; dental hygiene;
posture; running shoes; yoga; swimming; cycling safety; mountain climbing; camping; fishing;
birdwatching; wolves; dolphins; octopuses; ants; spiders; frogs; camels; horses; cats; dogs;
parrots; whales; jellyfish; the Arctic; Antarctica; the Himalayas; the Nile; the Grand Canyon;
Iceland; Japan; Brazil; Kenya; Australia; Canada; India; Mexico; Egypt; Greece; Venice;
New York City; the Alps; the Pacific Ocean; the Dead Sea; the Great Barrier Reef; comets;
asteroids; Jupiter; Saturn's rings; the Milky Way; rockets; the International Space
Station; satellites; GPS; radio; television; the telephone; smartphones; laptops; printers;
3D printing; virtual reality; video games; chess engines; search engines; email; passwords;
encryption; firewalls; phishing; cloud computing; operating systems; compilers; SQL;
data visualization; statistics; averages and medians; percentages;
algebra; geometry; calculus; logarithms; the Fibonacci sequence; graph theory; binary search;
dynamic programming; object-oriented programming; functional programming; JavaScript; Rust;
C programming; Linux; command-line tools; APIs; web servers; HTML; CSS; accessibility;
open source; software licenses; code review; agile teams; project deadlines; remote work;
public speaking; negotiation; leadership; customer service; budgeting; taxes; insurance;
mortgages; credit scores; inflation; supply and demand; small businesses; marketing;
advertising; branding; startups; patents; contracts; voting; the United Nations; human rights;
journalism; libraries; museums; architecture; bridges; skyscrapers; roads; canals; dams;
nuclear power; hydrogen fuel; oil spills; air pollution; deforestation; endangered species;
national parks; recycling plastics; water purification; droughts; hurricanes; tornadoes;
lightning; fog; the seasons; calendars; clocks; maps; compasses; the alphabet; poetry; novels;
fairy tales; mythology; the Olympics marathon; medieval castles; knights; pirates; Vikings;
samurai; the Ottoman Empire; the Ming dynasty; the Inca; the American Revolution;
the abolition of slavery; women's suffrage; the civil rights movement; the Berlin Wall;
the invention of paper; the steam engine; the light bulb; penicillin; X-rays; genetics;
stem cells; the brain; memory; emotions; habits; motivation; procrastination; creativity;
kindness; gratitude; grief; parenting; toddlers; teenagers; grandparents; weddings; birthdays;
holidays; moving house; cleaning; laundry; cooking for one; meal planning; grocery shopping"""
)

WIDE_TEMPLATES = [
    "Can you explain {t} in simple terms?",
    "I am writing an essay on {t}. Give me an outline.",
    "What are common misconceptions about {t}?",
    "Compare {t} with something from everyday life.",
    "Write a dialogue between a teacher and a student about {t}.",
    "Give me a step-by-step guide related to {t}.",
    "What should a beginner know about {t}?",
    "Write a limerick about {t}.",
    "Create a quiz with four questions about {t}, and give the answers.",
    "Explain {t} in exactly three sentences.",
    "What is the future of {t}?",
    "Write a short persuasive paragraph about {t}.",
    "Describe a day in the life of someone who works with {t}.",
    "Summarize the key ideas of {t} as a bulleted list.",
    "Write an email to a friend recommending they learn about {t}.",
    "What questions would an expert ask about {t}?",
    "Explain {t} using an analogy.",
    "Write a product description for something inspired by {t}.",
]

HELD_OUT_TEMPLATES = [
    "Tell me about {t}.",
    "Why is {t} important? Explain step by step.",
    "Write a haiku and then a short explanation about {t}.",
    "Write a Python function related to {t}, and explain how it works.",
]


def main() -> None:
    data_dir = Path(__file__).resolve().parents[1] / "data"  # benchmarks/data/
    topics, held = TOPICS, HELD_OUT_TOPICS
    train = [tpl.format(t=t) for t, tpl in itertools.product(topics, TEMPLATES)]
    # Interleave so that any prefix of the file covers many topics and templates.
    train = [train[(i * 37) % len(train)] for i in range(len(train))]
    heldout = [tpl.format(t=t) for t, tpl in zip(held, itertools.cycle(HELD_OUT_TEMPLATES))]
    wide_topics = TOPICS + [t for t in WIDE_TOPICS if t not in TOPICS]
    overlap = {t.lower() for t in wide_topics} & {t.lower() for t in held}
    overlap |= set(WIDE_TEMPLATES + TEMPLATES) & set(HELD_OUT_TEMPLATES)
    if overlap:
        raise SystemExit(f"held-out topics or templates in the training sets: {sorted(overlap)}")
    wide = [
        tpl.format(t=t) for t, tpl in itertools.product(wide_topics, TEMPLATES + WIDE_TEMPLATES)
    ]
    stride = next(k for k in range(101, len(wide)) if math.gcd(k, len(wide)) == 1)
    wide = [wide[(i * stride) % len(wide)] for i in range(len(wide))]
    sets = (("train_prompts", train), ("train_prompts_wide", wide), ("heldout_prompts", heldout))
    for name, prompts in sets:
        path = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"{path}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
