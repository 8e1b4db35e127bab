"""DESIGN.md, RNG contract 1: nothing under src/specdec outside specdec/rng/ creates randomness.

The scan reads Python tokens, so words in strings and comments do not count, and any use in code
does: torch/numpy/Python/Triton RNG calls, generators and seeding, in-place random fills, and
the `random` / `secrets` modules. The scanner is itself tested on snippets it must flag and
snippets it must leave alone.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

import specdec

SOURCE_ROOT = Path(specdec.__file__).parent
RNG_PACKAGE = SOURCE_ROOT / "rng"

# Names that are randomness wherever they appear in code.
FORBIDDEN_NAMES = {
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randint4x",
    "randperm", "multinomial", "bernoulli", "Generator", "manual_seed", "manual_seed_all",
    "initial_seed", "get_rng_state", "set_rng_state", "fork_rng", "uniform_", "exponential_",
    "normal_", "random_", "cauchy_", "log_normal_", "geometric_", "default_rng", "RandomState",
    "SystemRandom", "urandom", "randbits", "randrange", "token_bytes", "philox",
}  # fmt: skip
# Names that are randomness as an attribute (torch.normal, np.random, torch.distributions) ...
FORBIDDEN_ATTRIBUTES = {"normal", "poisson", "random", "distributions"}
# ... or as a called attribute (torch.seed(), random.choice(...)); `params.seed` is data.
FORBIDDEN_METHODS = {"seed", "choice", "shuffle", "sample_n"}
# Modules that only produce randomness.
FORBIDDEN_MODULES = {"random", "secrets"}


def randomness_uses(source: str) -> list[str]:
    """'line: text' for each token sequence in `source` that creates randomness."""
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT)
    ]
    found = []
    for i, token in enumerate(tokens):
        if token.type != tokenize.NAME:
            continue
        before = tokens[i - 1].string if i else ""
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        hit = token.string in FORBIDDEN_NAMES
        hit |= before == "." and token.string in FORBIDDEN_ATTRIBUTES
        hit |= before == "." and after == "(" and token.string in FORBIDDEN_METHODS
        hit |= before in ("import", "from") and token.string in FORBIDDEN_MODULES
        if hit:
            found.append(f"{token.start[0]}: {token.line.strip()}")
    return found


def source_files() -> list[Path]:
    return sorted(p for p in SOURCE_ROOT.rglob("*.py") if RNG_PACKAGE not in p.parents)


def test_no_randomness_outside_rng():
    files = source_files()
    assert SOURCE_ROOT / "audit" / "checks.py" in files  # the scan does see the tree
    offenders = {
        str(p.relative_to(SOURCE_ROOT)): uses
        for p in files
        if (uses := randomness_uses(p.read_text(encoding="utf-8")))
    }
    assert not offenders, f"randomness outside specdec/rng/: {offenders}"


@pytest.mark.parametrize(
    "snippet",
    [
        "x = torch.rand(3)",
        "x = torch.randn_like(y)",
        "i = torch.randint(0, 5, (2,))",
        "p = torch.randperm(4)",
        "t = torch.multinomial(probs, 1)",
        "b = torch.bernoulli(p)",
        "g = torch.Generator().manual_seed(0)",
        "torch.manual_seed(0)",
        "torch.cuda.manual_seed_all(1)",
        "s = torch.seed()",
        "x.uniform_()",
        "x.exponential_()",
        "x.normal_(0, 1)",
        "x = torch.normal(mean, std)",
        "x = torch.poisson(rates)",
        "d = torch.distributions.Categorical(probs)",
        "import random",
        "from random import random",
        "import secrets",
        "import numpy as np\nx = np.random.rand(3)",
        "rng = numpy.random.default_rng(0)",
        "r = tl.rand(seed, offsets)",
        "r = tl.randint4x(seed, offsets)",
        "import os\nkey = os.urandom(8)",
        "x = rng.choice(items)",
    ],
)
def test_scanner_flags_randomness(snippet):
    assert randomness_uses(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "from specdec.rng import Stream, gumbel, uniform",
        "u = uniform(seeds, positions, Stream.ACCEPT, 1)",
        "seed = params.seed",
        "run(quick, seed=args.seed)",
        "out = sample(logits, seeds, positions, temperature=1.0)",
        '"""Never calls torch.rand or torch.Generator."""',
        "# torch.manual_seed(0) would break the contract",
        "message = 'import random'",
    ],
)
def test_scanner_leaves_clean_code_alone(snippet):
    assert not randomness_uses(snippet), snippet
