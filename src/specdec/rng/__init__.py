"""Keyed counter-based randomness: the only code in specdec that turns keys into random numbers.

`uniform` and `gumbel` are pure functions of (seed, position, stream, step, lane); see draws.py.
"""

from specdec.rng.draws import (
    MAX_TREE_NODES,
    UNIFORM32_MAX,
    Stream,
    gumbel,
    random_words,
    tree_draft_stream,
    uniform,
    uniform_to_gumbel,
    words_to_uniform32,
    words_to_uniform64,
)
from specdec.rng.philox import philox4x32_10, use_native_rows
from specdec.rng.seeds import (
    derive_seed,
    engine_request_seed,
    fresh_request_id,
    fresh_seed,
    to_signed64,
)

__all__ = [
    "MAX_TREE_NODES",
    "UNIFORM32_MAX",
    "Stream",
    "derive_seed",
    "engine_request_seed",
    "fresh_request_id",
    "fresh_seed",
    "gumbel",
    "philox4x32_10",
    "random_words",
    "to_signed64",
    "tree_draft_stream",
    "uniform",
    "uniform_to_gumbel",
    "use_native_rows",
    "words_to_uniform32",
    "words_to_uniform64",
]
