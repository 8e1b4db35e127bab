"""Rotary position embeddings and their scaling variants, computed as `transformers` computes them.

`RopeScaling` is a checkpoint's `rope_scaling` (`llama3`, `yarn`, `linear`, `dynamic`; Phi-3's
`longrope`), read once at load time (an unknown type is refused by name); `rope_inv_freq` and
`RotaryEmbedding` turn it into inverse frequencies and cos/sin tables. Nothing here reads files or
samples.

Four conventions, stated once:
- YaRN's attention factor m (`transformers` multiplies cos and sin by it, so every score by m^2)
  is folded into the attention scale instead (`attention_scale`): cached keys stay unscaled, and
  every attention path (eager, fused decode, Triton) takes it through its `scale` argument.
- Dynamic NTK: `transformers` recomputes the frequencies from the longest position of each
  forward call, so in one call every token gets the frequencies of the call's last position; with
  a KV cache, earlier tokens keep the ones they were rotated with. Here the token at position p
  is rotated with the frequencies for sequence length max(p + 1, max_position_embeddings),
  which is exactly what `transformers` does when p is the newest token of a call (its
  token-by-token decoding), and depends on nothing but p: chunked prefill, batching, speculation
  and preemption leave a token's rotation unchanged. (A one-call prefill of P >
  max_position_embeddings tokens in `transformers` rotates all of them for length P instead.)
- LongRoPE (Phi-3): `transformers` picks the short or the long factors by the longest position of
  each forward call (long past `original_max_position_embeddings`), so token-by-token decoding
  rotates the token at position p with the long factors exactly when p + 1 > original. Here that
  rule holds for every token, whatever its step: positions from `original_max_position_embeddings`
  on take the long factors, earlier ones the short (`RotaryEmbedding.inv_freq_at`). (Phi-3's
  `generate` instead recomputes the whole cache with the long factors once the sequence passes
  the original length, and a one-call forward of a longer prompt rotates all of it with them.)
  Its attention factor m applies whatever the length, folded into the scale as YaRN's.
- Partial rotary (`partial_rotary_factor`, Phi-3): `transformers` rotates the first R of a head's
  D dimensions in pairs (i, i + R/2) and leaves the rest. The checkpoint's q/k rows are laid out
  at load (`partial_rotary_layout`) so that this is full rotary over D whose extra pairs have
  frequency 0 (cos 1, sin 0): every RoPE kernel then computes it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

ROPE_SCALING_TYPES = ("llama3", "yarn", "linear", "dynamic")
# Phi-3's, accepted for that family alone (`parse_rope_scaling(..., longrope=True)`).
LONGROPE = "longrope"
# Keys of a `rope_scaling` dictionary that are not scaling parameters.
_NAME_KEYS = {"rope_type", "type", "rope_theta"}
_KNOWN_KEYS = {
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    },
    "linear": {"factor", "original_max_position_embeddings"},  # the latter unused, as in HF
    "dynamic": {"factor", "original_max_position_embeddings"},
    LONGROPE: {
        "short_factor",
        "long_factor",
        "factor",
        "attention_factor",
        "original_max_position_embeddings",
    },
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A checkpoint's RoPE scaling, resolved at load time (`transformers`' defaults applied).

    Attributes:
        rope_type: one of `ROPE_SCALING_TYPES`, or `LONGROPE`.
        factor: the context extension factor (linear: divisor of every frequency; llama3: of the
            low ones; yarn: of the interpolated ones; dynamic: in the NTK base formula;
            longrope: only for its default attention factor).
        low_freq_factor: llama3: frequencies with a wavelength above
            `original_max_position_embeddings / low_freq_factor` are divided by `factor`.
        high_freq_factor: llama3: those with a wavelength below
            `original_max_position_embeddings / high_freq_factor` stay as they are.
        original_max_position_embeddings: the pretraining context (llama3, yarn, longrope: the
            first position of its long factors; dynamic: the model's `max_position_embeddings`,
            which `transformers` uses as the reference).
        beta_fast: yarn: rotations bounding the extrapolated (high-frequency) dimensions.
        beta_slow: yarn: rotations bounding the interpolated (low-frequency) dimensions.
        attention_factor: yarn, longrope: m, the factor `transformers` multiplies cos and sin by
            (yarn: `attention_factor`, else from `mscale` / `mscale_all_dim`, else
            0.1 ln(factor) + 1; longrope: `attention_factor`, else
            sqrt(1 + ln(factor) / ln(original)) for factor > 1); 1.0 for the other types.
        truncate: yarn: round the correction range to whole dimensions.
        short_factor: longrope: [rotary_dim / 2] divisors of the frequencies of positions before
            `original_max_position_embeddings`.
        long_factor: longrope: [rotary_dim / 2] divisors of those of later positions.
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in (*ROPE_SCALING_TYPES, LONGROPE):
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: "
                f"{', '.join(ROPE_SCALING_TYPES)} (or no rope_scaling)"
            )
        if not self.factor > 0:
            raise ValueError(f"{self.rope_type} rope scaling needs factor > 0, got {self.factor}")
        if self.rope_type in ("llama3", "yarn", "dynamic", LONGROPE) and not (
            self.original_max_position_embeddings and self.original_max_position_embeddings > 0
        ):
            raise ValueError(
                f"{self.rope_type} rope scaling lacks original_max_position_embeddings"
            )
        if self.rope_type == "llama3" and (
            self.low_freq_factor is None
            or self.high_freq_factor is None
            or self.high_freq_factor <= self.low_freq_factor
        ):
            raise ValueError(
                "llama3 rope scaling needs low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.rope_type == LONGROPE and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope rope scaling needs short_factor and long_factor")

    @property
    def is_dynamic(self) -> bool:
        """Whether a token's frequencies depend on its position (dynamic NTK)."""
        return self.rope_type == "dynamic"

    def context_length(self, max_position_embeddings: int) -> int:
        """The context the scaled model declares, as vLLM derives it: `max_position_embeddings`
        for llama3 and longrope (they already state the extended context), original x factor
        for yarn, `max_position_embeddings` x factor for linear and dynamic."""
        if self.rope_type in ("llama3", LONGROPE):
            return max_position_embeddings
        if self.rope_type == "yarn":
            assert self.original_max_position_embeddings is not None
            return max(
                max_position_embeddings, int(self.original_max_position_embeddings * self.factor)
            )
        return int(max_position_embeddings * self.factor)

    def to_hf(self) -> dict[str, Any]:
        """The `rope_scaling` dictionary of a HF config.json that parses back to this."""
        values: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            values |= {
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        elif self.rope_type == "yarn":
            values |= {
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "attention_factor": self.attention_factor,
                "truncate": self.truncate,
            }
        elif self.rope_type == LONGROPE:
            values |= {
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor,
                "short_factor": list(self.short_factor or ()),
                "long_factor": list(self.long_factor or ()),
            }
        return values


def parse_rope_scaling(
    scaling: dict[str, Any], max_position_embeddings: int, longrope: bool = False
) -> RopeScaling | None:
    """A HF `rope_scaling` / `rope_parameters` dictionary -> RopeScaling (None for "default"),
    with `transformers`' defaults and validation rules. `longrope`: accept Phi-3's `longrope`
    (the family whose generation it is checked against).

    Raises:
        ValueError: an unknown or unsupported type (named, with the supported list), a missing
            or invalid parameter, a parameter the type does not have.
    """
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    supported = (*ROPE_SCALING_TYPES, LONGROPE) if longrope else ROPE_SCALING_TYPES
    if rope_type not in supported:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(supported)} (or no rope_scaling)"
        )
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    unknown = sorted(set(scaling) - _NAME_KEYS - _KNOWN_KEYS[rope_type] - {"partial_rotary_factor"})
    if unknown:
        raise ValueError(f"{rope_type} rope scaling has unknown keys {unknown}")
    if rope_type == LONGROPE:
        return _parse_longrope(scaling, max_position_embeddings)
    factor = scaling.get("factor")
    original = scaling.get("original_max_position_embeddings")
    if rope_type == "yarn":
        original = int(original or max_position_embeddings)
        if factor is None:  # transformers: the ratio of the two context lengths
            factor = max_position_embeddings / original
        return RopeScaling(
            rope_type="yarn",
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            attention_factor=yarn_attention_factor(
                float(factor),
                scaling.get("attention_factor"),
                scaling.get("mscale"),
                scaling.get("mscale_all_dim"),
            ),
            truncate=bool(scaling.get("truncate", True)),
        )
    if factor is None:
        raise ValueError(f"{rope_type} rope scaling lacks 'factor'")
    if rope_type == "llama3":
        try:
            return RopeScaling(
                rope_type="llama3",
                factor=float(factor),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(
                    original if original is not None else max_position_embeddings
                ),
            )
        except KeyError as err:
            raise ValueError(f"llama3 rope scaling lacks {err.args[0]!r}") from err
    if rope_type == "dynamic":
        # transformers scales against max_position_embeddings (not the dictionary's
        # original_max_position_embeddings, which it ignores for this type).
        return RopeScaling(
            rope_type="dynamic",
            factor=float(factor),
            original_max_position_embeddings=max_position_embeddings,
        )
    return RopeScaling(rope_type="linear", factor=float(factor))


def _parse_longrope(scaling: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """Phi-3's longrope as `transformers`' `_compute_longrope_parameters` reads it: without a
    `factor`, the ratio max_position_embeddings / original sets the default attention factor."""
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ValueError(f"longrope rope scaling lacks {key!r}")
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        rope_type=LONGROPE,
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factor=tuple(float(value) for value in scaling["short_factor"]),
        long_factor=tuple(float(value) for value in scaling["long_factor"]),
    )


def yarn_attention_factor(
    factor: float,
    attention_factor: float | None,
    mscale: float | None,
    mscale_all_dim: float | None,
) -> float:
    """YaRN's m (Peng et al. 2023, eq. 23): the given one, else the ratio of
    `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set (DeepSeek's
    spelling), else 0.1 ln(factor) + 1 (1 for factor <= 1), as `transformers` resolves it."""
    if attention_factor is not None:
        return float(attention_factor)

    def get_mscale(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _default_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    # On the CPU explicitly: models are built under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    return 1.0 / (rope_theta ** (exponents.to(torch.float32) / head_dim))  # [D / 2]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    old_len = scaling.original_max_position_embeddings
    assert old_len is not None
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, rope_theta: float, scaling: RopeScaling) -> torch.Tensor:
    # YaRN (Peng et al. 2023, section 3.2): extrapolate the dimensions that rotate more than
    # beta_fast times over the original context, interpolate those below beta_slow, ramp between.
    dim, base, original = head_dim, rope_theta, scaling.original_max_position_embeddings
    assert original is not None

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def dynamic_inv_freq(
    head_dim: int, rope_theta: float, scaling: RopeScaling, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK frequencies for sequence lengths `seq_lens` ([T] int64): the base grows as
    theta ((factor L / L0) - (factor - 1))^(D / (D - 2)) with L = max(seq_len, L0), L0 the
    model's max_position_embeddings (`transformers`' `_compute_dynamic_ntk_parameters`).

    Returns: [T, D / 2] float32 on `seq_lens`' device.
    """
    reference = scaling.original_max_position_embeddings
    assert reference is not None
    seq = torch.clamp(seq_lens, min=reference)  # [T] int64
    base = rope_theta * ((scaling.factor * seq / reference) - (scaling.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )  # [T] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=seq.device)
    exponents = exponents.to(torch.float32) / head_dim
    return 1.0 / (base[:, None] ** exponents)  # [T, D / 2]


@dataclass(frozen=True, slots=True)
class PlainRope:
    """Unscaled RoPE of its own base, beside a model's main one (Gemma 3's sliding layers
    rotate with `rope_local_base_freq`); a `RopeConfig`."""

    head_dim: int
    rope_theta: float
    rotary_dim: int
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: Sequence[float] | None = None


class RopeConfig(Protocol):
    """What RoPE reads of a model's config (`ModelConfig`, or a drafter's layer config)."""

    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rope_freq_factors: Sequence[float] | None

    @property
    def rotary_dim(self) -> int:
        """The rotated dimensions of a head (head_dim unless partial rotary)."""
        ...


def rope_inv_freq(config: RopeConfig, long: bool = False) -> torch.Tensor:
    """The RoPE inverse frequencies of `config` (for dynamic NTK: those of positions inside
    `max_position_embeddings`, i.e. plain RoPE; for longrope: the short factors', or with
    `long` the long factors'), with GGUF frequency factors applied. Under partial rotary the
    rotary_dim / 2 frequencies are followed by zeros (see `partial_rotary_layout`).

    Returns:
        [head_dim // 2] float32 on the CPU.
    """
    scaling, dim = config.rope_scaling, config.rotary_dim
    if scaling is not None and scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(dim, config.rope_theta, scaling)
    else:
        inv_freq = _default_inv_freq(dim, config.rope_theta)
    if scaling is not None and scaling.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == LONGROPE:
        factors = scaling.long_factor if long else scaling.short_factor
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if config.rope_freq_factors is not None:
        # llama.cpp divides each frequency by its factor (`rope_freqs.weight`).
        inv_freq = inv_freq / torch.tensor(
            config.rope_freq_factors, dtype=torch.float32, device="cpu"
        )
    return torch.nn.functional.pad(inv_freq, (0, (config.head_dim - dim) // 2))


def partial_rotary_layout(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's q/k dimensions that makes partial rotary a full one.

    `transformers` rotates dimensions i and R/2 + i (i < R/2) of the first R and leaves the
    other D - R; the RoPE kernels rotate i and D/2 + i for every i < D/2. Taking the rotated
    pairs to i and D/2 + i and the others to the pairs between (whose frequency is 0:
    `rope_inv_freq`) lets every kernel compute `transformers`' partial rotary exactly. q and k
    are reordered alike, so every q.k is unchanged (values are not reordered).

    Returns: [head_dim] int64: new dimension j holds the checkpoint's dimension layout[j].
    """
    rotated, kept = rotary_dim // 2, (head_dim - rotary_dim) // 2

    def span(start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device="cpu")

    return torch.cat(
        (
            span(0, rotated),  # first halves of the rotated pairs
            span(rotary_dim, rotary_dim + kept),  # half of the dimensions left alone
            span(rotated, rotary_dim),  # second halves of the rotated pairs
            span(rotary_dim + kept, head_dim),  # the other half
        )
    )


def attention_scale(config: RopeConfig, query_pre_attn_scalar: float | None = None) -> float:
    """The softmax scale of every attention over RoPE'd queries and keys: 1 / sqrt(head_dim)
    (1 / sqrt(query_pre_attn_scalar) when given: Gemma's), times m^2 for YaRN and longrope
    (their attention factor m applied to both queries and keys; under partial rotary the
    loader divides the unrotated q dimensions by m^2)."""
    factor = config.rope_scaling.attention_factor if config.rope_scaling is not None else 1.0
    base = config.head_dim if query_pre_attn_scalar is None else query_pre_attn_scalar
    return base**-0.5 * factor * factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings, computed per step from absolute positions
    (unscaled by YaRN's and longrope's attention factor: see `attention_scale`)."""

    def __init__(self, config: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        self.scaling = config.rope_scaling
        # Kept in float32; load models in their dtype rather than casting with `.to(dtype)`.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # Longrope: the long factors' table, for positions from `long_from` on (else None).
        longrope = self.scaling is not None and self.scaling.rope_type == LONGROPE
        self.long_from = self.scaling.original_max_position_embeddings if longrope else None
        long_inv_freq = rope_inv_freq(config, long=True) if longrope else None
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def inv_freq_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The inverse frequencies the tokens at `positions` ([T] int64) rotate with: `inv_freq`
        ([D / 2]) when one table serves every position, else [T, D / 2] (longrope: the long
        factors' from `original_max_position_embeddings` on). Not for dynamic NTK."""
        if self.long_inv_freq is None:
            return self.inv_freq
        long = positions >= self.long_from  # [T]
        return torch.where(long[:, None], self.long_inv_freq, self.inv_freq)  # [T, D / 2]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: positions: [T] int64. Returns: (cos, sin), each [T, head_dim] float32."""
        inv_freq = self.inv_freq_at(positions).to(torch.float32)  # [D / 2] or [T, D / 2]
        if self.scaling is not None and self.scaling.is_dynamic:
            seq_lens = positions + 1
            grown = dynamic_inv_freq(self.head_dim, self.rope_theta, self.scaling, seq_lens)
            # Inside the reference length: plain RoPE, bit for bit.
            inside = seq_lens <= self.scaling.original_max_position_embeddings
            inv_freq = torch.where(inside[:, None], inv_freq[None], grown)  # [T, D / 2]
        freqs = positions[:, None].to(torch.float32) * inv_freq  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates [T, H, D] queries or keys by their positions' angles (the "rotate half" layout).

    Args:
        x: [T, H, D] queries or keys.
        cos: [T, D] float32 from `RotaryEmbedding`.
        sin: [T, D] float32.
    """
    cos = cos.to(x.dtype)[:, None]  # [T, 1, D]
    sin = sin.to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
