"""Passkey retrieval prompts over offline filler text, and a degeneration check (shared by the
long-context tests and `benchmarks/bench_long_context_cpu.py`).

Filler: the prose paragraphs of the Python documentation's topics (`pydoc_data.topics`, in every
CPython install: about 465,000 characters), without digits so that the passkey is the only number.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from specdec.models.tokenizer import Tokenizer

INSTRUCTION = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"


def needle(passkey: str) -> str:
    return f"\nThe pass key is {passkey}. Remember it. {passkey} is the pass key.\n"


@functools.cache
def filler_text() -> str:
    """Prose paragraphs of the stdlib's documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            text = " ".join(paragraph.split())
            if (
                len(text) > 80
                and not paragraph.startswith((" ", "\t"))
                and not any(c.isdigit() for c in text)
                and "::=" not in text
                and ">>>" not in text
                and "*" not in text
            ):
                paragraphs.append(text)
    return "\n".join(paragraphs)


@functools.cache
def _filler_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(filler_text(), add_special_tokens=False))


def passkey_prompt(tokenizer: Tokenizer, num_tokens: int, passkey: str, depth: float) -> list[int]:
    """Chat prompt token ids of about `num_tokens` tokens: the instruction, filler with the
    passkey sentence at fraction `depth` of it, the question, and the assistant's reply opened
    with "The pass key is" (the model continues it)."""

    def render(before: str, after: str) -> list[int]:
        content = INSTRUCTION + before + needle(passkey) + after + QUESTION
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": ANSWER_PREFIX},
        ]
        return tokenizer.encode_chat(
            messages, add_generation_prompt=False, continue_final_message=True
        )

    overhead = len(render("", ""))
    ids = _filler_ids(tokenizer)
    wanted = num_tokens - overhead
    if not 0 < wanted <= len(ids):
        raise ValueError(f"{num_tokens} tokens: the filler holds {len(ids)} + {overhead} at most")
    cut = int(wanted * depth)
    before = tokenizer.decode(ids[:cut]).rstrip()
    after = tokenizer.decode(ids[cut:wanted]).lstrip()
    return render(before, after)


def repeated_ngram_loop(tokens: Sequence[int], max_n: int = 4, min_repeats: int = 4) -> bool:
    """Whether some n-gram (n <= max_n) occurs `min_repeats` times in a row somewhere in
    `tokens`: the loop a degenerate model falls into ("1 1 1 1", ", the, the, the, the")."""
    tokens = list(tokens)
    for n in range(1, max_n + 1):
        for start in range(len(tokens) - n * min_repeats + 1):
            gram = tokens[start : start + n]
            if all(
                tokens[start + r * n : start + (r + 1) * n] == gram for r in range(1, min_repeats)
            ):
                return True
    return False
