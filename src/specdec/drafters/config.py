"""Speculation settings with vLLM's names (`speculative_config`); their defaults and limits are
defined here once. Validation only: no tensors, no randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specdec.verify import VERIFY_METHODS

# Most drafts a round may verify (a request may ask for more than the configured K, up to this).
MAX_NUM_SPECULATIVE_TOKENS = 32
SPECULATIVE_METHODS = (
    "ngram",
    "draft_model",
    "eagle",
    "eagle3",
    "mtp",
    "dflash",
    "dspark",
    "medusa",
)
# Methods whose drafter is loaded from `model` (a directory or file).
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark", "medusa")
# Methods whose `model` may be left out for the built-in target: the shipped head is used.
SHIPPED_HEAD_METHODS = ("eagle", "mtp")
# Methods whose drafter is an EAGLE head (one cache layer beside the target's; under tensor
# parallelism it runs on the driver with the whole-vocabulary layers).
EAGLE_HEAD_METHODS = ("eagle", "eagle3", "mtp")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# The default verifier: its tokens are plain sampling's whatever the drafter proposes, so a
# seeded request replays whatever K the adaptive policy picks (DESIGN.md, batch invariance).
DEFAULT_REJECTION_SAMPLE_METHOD = "coupled"


# Methods that draft trees (`speculative_config["tree"]`).
TREE_METHODS = ("eagle", "eagle3", "mtp", "draft_model", "medusa")
TREE_KEYS = ("nodes", "depth", "topk")


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """A draft tree per round (`speculative_config["tree"]`), EAGLE-2 style.

    A sampled request (temperature > 0) grows level by level: the root's `topk` best children,
    then at each depth the `topk` frontier nodes of highest cumulative draft confidence each
    get `topk` children, until `nodes` nodes or `depth` levels. A greedy request (temperature
    0, where any tree is exact) grows best-first: `depth` steps, each making nodes of the
    max(1, nodes // depth) candidates (the last step: the budget left) of highest cumulative
    draft log-probability among the children the previous steps' nodes offered
    (`drafters.tree.grow_best_first`).

    Attributes:
        nodes: most draft nodes per round (N; the round verifies N + 1 target rows).
        depth: most levels (the longest path; at most `nodes`). Level by level the budget caps
            it too: level 1 holds `topk` nodes and every later one topk^2, so a sampled tree
            has at most 1 + ceil((nodes - topk) / topk^2) levels; a greedy tree can reach
            `depth`.
        topk: children per expanded node, and expanded nodes per level (sampled trees; greedy
            trees do not read it).
    """

    nodes: int
    depth: int
    topk: int

    def __post_init__(self) -> None:
        for name in TREE_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.tree.{name} must be an integer >= 1")
        check_num_speculative_tokens(self.nodes, "speculative_config.tree.nodes")
        if self.depth > self.nodes:
            raise ValueError(
                f"speculative_config.tree.depth ({self.depth}) cannot exceed nodes ({self.nodes})"
            )

    @staticmethod
    def from_dict(values: object) -> TreeConfig | None:
        if values is None or isinstance(values, TreeConfig):
            return values
        if isinstance(values, list | tuple):
            raise ValueError(
                "speculative_config.tree takes a dict of nodes, depth, topk; static choice "
                "lists (Medusa's medusa_choices, e.g. mc_sim_7b_63) are not supported"
            )
        if not isinstance(values, dict):
            raise ValueError("speculative_config.tree must be a dict of nodes, depth, topk")
        unknown = sorted(set(values) - set(TREE_KEYS))
        missing = sorted(set(TREE_KEYS) - set(values))
        if unknown or missing:
            raise ValueError(
                f"speculative_config.tree needs exactly the keys {list(TREE_KEYS)}; "
                f"unknown {unknown}, missing {missing}"
            )
        return TreeConfig(**values)


def check_num_speculative_tokens(k: object, name: str = "num_speculative_tokens") -> None:
    """Raises ValueError naming `name` unless k is an int in [1, MAX_NUM_SPECULATIVE_TOKENS]."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(
            f"{name} must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}"
        )


def check_mtp_layers(value: object, method: str) -> None:
    """Raises ValueError naming `mtp_layers` unless it is "all" or an int >= 1 (and, when not
    "all", the method is "mtp")."""
    if value == "all":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f'speculative_config.mtp_layers must be "all" or an integer >= 1, got {value!r}'
        )
    if method != "mtp":
        raise ValueError(f'speculative_config.mtp_layers applies to method "mtp", not {method!r}')


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys.

    Attributes:
        method: "ngram" (prompt lookup), "draft_model", "eagle" (a head over the target's
            hidden features), "mtp" (the MTP layers of the target's own checkpoint, or any
            "eagle" head), "eagle3" (vLLM's name for EAGLE-3 heads: "eagle"
            restricted to them), "dflash" (a parallel block drafter over the target's
            features), "dspark" (dflash + Markov head + confidence-scheduled verify length) or
            "medusa" (heads over the target's last hidden state, one draft each; a tree's
            depth-i nodes from head i).
        model: the draft model (a Hugging Face directory or a GGUF file) for "draft_model";
            "truncated:N" uses the target's first N layers (with its embeddings and head). For
            "eagle"/"mtp": a head directory (config.json + model.safetensors, as written by
            `specdec train-drafter --kind eagle`, an EAGLE-1/2 checkpoint in SafeAILab's
            format, or an EAGLE-3 checkpoint in SpecForge's / SGLang's / vLLM's or speculators'
            format: recognised from its config and tensors). For "eagle3": an EAGLE-3
            checkpoint. For "mtp": also a target checkpoint whose files hold MTP layers (MiMo's
            `model.mtp_layers.{k}`, DeepSeek-V3's `model.layers.{N + k}`: `drafters.mtp`);
            left out on a target other than the built-in one, the target's own directory.
            For "dflash"/"dspark": a block drafter
            directory (written by `specdec train-drafter --kind dflash|dspark`). For "medusa":
            a directory of Medusa heads in FasterDecoding's or vLLM's format. "eagle"/"mtp"
            without a model on the built-in target take the head shipped in the package.
        num_speculative_tokens: drafts per round, K.
        draft_sample_method: "probabilistic" (drafts sampled from the draft distribution, which
            the verifier is given) or "greedy" (the draft's argmax, verified as a one-hot draft).
        rejection_sample_method: "coupled" (the default: drafts are drawn with the target's
            own noise and the emitted tokens are plain sampling's, token for token, whatever
            the drafter and K), "standard" (Leviathan et al.) or "block" (Sun et al.). All
            three are exact in law; with the adaptive policy on, standard/block replay a seeded
            request token for token only with K pinned (`adaptive`).
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by "ngram".
        adaptive: choose each round's K in [0, num_speculative_tokens] from measured step
            costs at the batch size and the running acceptance (`specdec.engine.spec_policy`):
            the device rounds' K on CUDA, the synchronous step's on the CPU (where a drafted
            step costs about twice a plain one from batch 8 on, so K = 0 wins there); False
            pins K to num_speculative_tokens.
            Standard/block outputs stay exact in law either way, but a seeded request replays
            token for token only with K pinned (the chosen K depends on the batch and on
            measured timings); coupled and greedy outputs equal plain decoding's whatever K is.
        tree: draft trees instead of chains ({"nodes": N, "depth": D, "topk": k}, a
            `TreeConfig`), verified exactly with `specdec.verify.tree`; eagle/eagle3/mtp/
            draft_model/medusa (no deeper than its heads), not with block verification, and on
            the synchronous engine path only (rounds then verify N nodes;
            num_speculative_tokens is not used).
        plain_arm: with `adaptive`, also offer the policy arm P: keep the batch in the
            overlapped loop, drafting nothing (outside device rounds, or without entering them),
            while that is predicted to be faster (its cost: the plain step at the batch bucket;
            its tokens per step: 1); arrivals and finishes do not end it (s41). Off by default:
            on the H200 (s12) it kept batch 32 at 0.97-1.01x plain when chosen from the start,
            but batch 64 ran at 0.72-0.85x with it against 0.85-1.05x without (BENCHMARKS.md
            area 2b); on an H100 (s41, the server at c = 16 / 64 / 256) the policy chose it for
            50 / 13 / 5 steps and nothing changed; on the CPU with async_scheduling on, where a
            K = 0 round costs about 1.25x a plain step, it keeps speculation at plain's speed
            (batch 1 / 8 / 32: 0.99x / 1.00x / 1.00x in process, 0.82x / 0.80x / 0.80x without;
            through the server 0.96x / 0.97x / 0.91x of `--no-spec`, no better than the
            synchronous step's). Off, K = 0 rounds are the policy's only way not to draft.
        mtp_layers: "mtp" on a checkpoint of several MTP layers: "all" (the default: layer k
            drafts position k, as the layers were trained, the last one past them;
            `drafters.mtp_chain`) or how many of the first layers to chain (1: layer 0 drafts
            every position, as vLLM's proposer does, with CUDA graphs, device rounds and
            trees, which chains of several layers do not have yet).
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    draft_sample_method: str = "probabilistic"
    rejection_sample_method: str = DEFAULT_REJECTION_SAMPLE_METHOD
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    plain_arm: bool = False
    tree: TreeConfig | None = None
    mtp_layers: str | int = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", TreeConfig.from_dict(self.tree))
        check_mtp_layers(self.mtp_layers, self.method)
        if self.tree is not None:
            if self.method not in TREE_METHODS:
                raise ValueError(
                    f"speculative_config.tree is implemented for the methods {TREE_METHODS}, "
                    f"not {self.method!r}"
                )
            if self.rejection_sample_method == "block":
                raise ValueError(
                    "speculative_config.tree cannot use rejection_sample_method 'block': block "
                    "verification is chain-only (use 'standard' or 'coupled')"
                )
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if (
            self.method in MODEL_METHODS
            and not self.model
            and self.method not in SHIPPED_HEAD_METHODS
        ):
            raise ValueError(f'speculative_config.method "{self.method}" needs "model"')
        check_num_speculative_tokens(
            self.num_speculative_tokens, "speculative_config.num_speculative_tokens"
        )
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.rejection_sample_method not in VERIFY_METHODS:
            raise ValueError(
                f"speculative_config.rejection_sample_method must be one of {VERIFY_METHODS}, "
                f"got {self.rejection_sample_method!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}"
            )
        if not isinstance(self.plain_arm, bool):
            raise ValueError(
                f"speculative_config.plain_arm must be true or false, got {self.plain_arm!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )

    @staticmethod
    def from_dict(values: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Builds a config from vLLM-style keys; unknown keys raise ValueError naming them."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}"
            )
        return SpeculativeConfig(**values)


def round_drafts(spec: SpeculativeConfig) -> int:
    """Drafts a round verifies by default: tree.nodes for a tree, else num_speculative_tokens."""
    return spec.tree.nodes if spec.tree is not None else spec.num_speculative_tokens
