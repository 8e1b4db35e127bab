"""Keyed random draws: the only place where keys become random numbers.

Every value is a pure function of (seed, position, stream, step, lane): one Philox4x32-10 call
with key = the request seed (two 32-bit words) and counter = (lane block, position, stream, step).
Nothing here keeps state, so a draw never depends on batch slot, batch size, padding or what
else was drawn.

Lane mapping (shared with the Triton twin, `philox_triton.py`):
- float32: lane L reads word L % 4 of the block at counter word 0 = L // 4.
- float64: lane L reads words 2 (L % 2) (high) and 2 (L % 2) + 1 (low) of block L // 2.
A stream is always drawn in one dtype, so the two mappings never meet on one key.

Resolution:
- float32: u = fl32(fl32(x) + 0.5) * 2**-32 for the 32-bit word x, clamped to at most 1 - 2**-24.
  Values lie in [2**-33, 1 - 2**-24]: the absolute resolution near 0 is 2**-32, so Gumbel noise
  -log(-log1p(-u)) reaches 22.9 (a token 18 logits below the top wins at its true rate).
- float64: u = (x53 + 0.5) * 2**-53 for the 53-bit integer x53 = (hi << 21) | (lo >> 11), clamped
  to at most 1 - 2**-53.
"""

from __future__ import annotations

import enum

import torch

from specdec.rng.philox import MASK32, native_rows, native_uniform32, philox4x32_10

UNIFORM32_MAX = 1.0 - 2.0**-24
UNIFORM64_MAX = 1.0 - 2.0**-53
MAX_COUNTER_WORD = 2**32 - 1


class Stream(enum.IntEnum):
    """Named random streams; the value is counter word 2. See DESIGN.md, "RNG contract"."""

    TARGET = 0  # plain sampling of the token at Q; the bonus token; coupled drafts. Keyed by (Q).
    DRAFT = 1  # a draft proposal at Q. Keyed by (Q, round anchor).
    ACCEPT = 2  # the acceptance uniform for the draft at Q. Keyed by (Q, round anchor).
    RESIDUAL = 3  # the recovered token at the first rejection at Q. Keyed by (Q).
    # Drafter training (specdec.train), never drawn while serving; the seed is the training seed.
    TRAIN_INIT = 4  # weight initialisation. Keyed by (parameter index), lane = element index.
    TRAIN_ORDER = 5  # the order of training examples. Keyed by (epoch), lane = example index.
    # A draft-tree node's proposal at Q. Keyed by (Q, round anchor, node index): the node index
    # rides in the stream word's upper bits (`tree_draft_stream`), so every node of a round's tree
    # has its own counter even where several nodes share a position.
    TREE_DRAFT = 6
    # A benchmark's load (`specdec.bench_serve`), never drawn while serving; the seed is the
    # benchmark's --seed. Keyed by (request index): the gap before that request arrives.
    BENCH_LOAD = 7


# Stream words of `Stream.TREE_DRAFT` carry the node index above the stream id's byte.
TREE_NODE_SHIFT = 8
MAX_TREE_NODES = 1 << (32 - TREE_NODE_SHIFT)


def tree_draft_stream(nodes: torch.Tensor) -> torch.Tensor:
    """[N] int64 tree node indices in [0, 2**24) -> [N] int64 stream words of
    `Stream.TREE_DRAFT` (stream id in the low byte, the node index above it): disjoint from every
    other stream's word, and from every other node's."""
    if nodes.dtype != torch.int64:
        raise TypeError(f"tree nodes must be an int64 tensor, got {nodes.dtype}")
    if nodes.numel() and (int(nodes.min()) < 0 or int(nodes.max()) >= MAX_TREE_NODES):
        raise ValueError(f"tree node indices must lie in [0, {MAX_TREE_NODES})")
    return int(Stream.TREE_DRAFT) | (nodes << TREE_NODE_SHIFT)


def _key_tensor(name: str, value: torch.Tensor | int, num_rows: int, device: torch.device):
    """Validates one key component and returns it as an int64 tensor of shape [num_rows]."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {value.dtype}")
        if value.dim() == 0:
            value = value.expand(num_rows)
        if value.shape != (num_rows,):
            raise ValueError(f"{name} must have shape [{num_rows}], got {list(value.shape)}")
        return value.to(device)
    return torch.full((num_rows,), int(value), dtype=torch.int64, device=device)


def _check_counter_word(name: str, value: torch.Tensor) -> None:
    if value.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # inside a CUDA graph nothing is read back; its caller built the words itself
    if value.numel() and (int(value.min()) < 0 or int(value.max()) > MAX_COUNTER_WORD):
        raise ValueError(f"{name} must lie in [0, 2**32), got range [{value.min()}, {value.max()}]")


def _keys(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    step: int | torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The checked [N] int64 words of a draw: positions, streams, steps (counter words 1-3) and
    the key's two halves."""
    if seeds.dim() != 1:
        raise ValueError(f"seeds must have shape [N], got {list(seeds.shape)}")
    if seeds.dtype != torch.int64:
        raise TypeError(f"seeds must be an int64 tensor, got {seeds.dtype}")
    num_rows, device = seeds.shape[0], seeds.device
    positions = _key_tensor("positions", positions, num_rows, device)
    streams = _key_tensor("stream", stream, num_rows, device)
    steps = _key_tensor("step", step, num_rows, device)
    _check_counter_word("positions", positions)
    _check_counter_word("step", steps)
    _check_counter_word("stream", streams)
    return positions, streams, steps, seeds & MASK32, (seeds >> 32) & MASK32


def random_words(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    num_blocks: int,
    *,
    step: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Raw Philox output words for blocks 0..num_blocks-1 of each row.

    Args:
        seeds: [N] int64, the request seeds (all 64 bits are used as the key).
        positions: [N] int64 in [0, 2**32), the position Q of the token the draw is for.
        stream: a `Stream`, or [N] int64 stream ids.
        num_blocks: number of counter blocks (counter word 0 = 0..num_blocks-1).
        step: int or [N] int64 in [0, 2**32), the extra counter word (a round anchor, or 0).

    Returns:
        [N, num_blocks, 4] int64 words in [0, 2**32).
    """
    positions, streams, steps, k0, k1 = _keys(seeds, positions, stream, step)
    device = seeds.device
    native = native_rows()
    if native is not None and device.type == "cpu":  # the same words, in C++
        return native(positions, streams, steps, k0, k1, num_blocks)
    blocks = torch.arange(num_blocks, dtype=torch.int64, device=device)[None, :]
    words = philox4x32_10(
        blocks,
        positions[:, None],
        streams[:, None],
        steps[:, None],
        k0[:, None],
        k1[:, None],
    )
    return torch.stack(words, dim=-1)


def words_to_uniform32(words: torch.Tensor) -> torch.Tensor:
    """Maps 32-bit words (int64 holding [0, 2**32)) to float32 uniforms in [2**-33, 1 - 2**-24]."""
    u = (words.to(torch.float32) + 0.5) * 2.0**-32
    return u.clamp_max(UNIFORM32_MAX)


def words_to_uniform64(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Maps word pairs to float64 uniforms in [2**-54, 1 - 2**-53] with 53-bit resolution."""
    x53 = (hi << 21) | (lo >> 11)
    u = (x53.to(torch.float64) + 0.5) * 2.0**-53
    return u.clamp_max(UNIFORM64_MAX)


def uniform(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    num_lanes: int,
    *,
    step: int | torch.Tensor = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Keyed uniforms strictly inside (0, 1).

    Args:
        seeds: [N] int64 request seeds.
        positions: [N] int64 position Q of the token each row draws for.
        stream: the `Stream` (or [N] int64 stream ids).
        num_lanes: number of values per row (vocabulary ids for a field, or slot indices).
        step: int or [N] int64: the round anchor for round-keyed streams, else 0.
        dtype: torch.float32 (32-bit words) or torch.float64 (53-bit values).

    Returns:
        [N, num_lanes] of `dtype`.

    RNG: stream `stream`, ceil(num_lanes / 4) (float32) or ceil(num_lanes / 2) (float64) Philox
    blocks per row.
    """
    if num_lanes < 1:
        raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
    num_rows = seeds.shape[0] if seeds.dim() == 1 else -1
    native = native_uniform32()
    if dtype == torch.float32 and native is not None and seeds.device.type == "cpu":
        # the same lanes in C++ (`words_to_uniform32` of the same words, without them)
        return native(*_keys(seeds, positions, stream, step), num_lanes)
    if dtype == torch.float32:
        words = random_words(seeds, positions, stream, -(-num_lanes // 4), step=step)
        num_blocks = words.shape[1]
        return words_to_uniform32(words.reshape(num_rows, 4 * num_blocks)[:, :num_lanes])
    if dtype == torch.float64:
        words = random_words(seeds, positions, stream, -(-num_lanes // 2), step=step)
        pairs = words.reshape(num_rows, 2 * words.shape[1], 2)[:, :num_lanes]
        return words_to_uniform64(pairs[..., 0], pairs[..., 1])
    raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def uniform_to_gumbel(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log1p(-u)): large noise comes from small u, where the
    uniforms are finest."""
    return -torch.log(-torch.log1p(-u))


def gumbel(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    num_lanes: int,
    *,
    step: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Keyed standard Gumbel noise, float32 [N, num_lanes], in [-2.81, 22.9].

    Same arguments and RNG as `uniform` (float32): lane v of a row is the noise of vocabulary id v.
    """
    return uniform_to_gumbel(uniform(seeds, positions, stream, num_lanes, step=step))
