"""Toy Markov models, the processings they run under, and the exact laws the checks compare with.

Pure computation in float64 from the toys' tables (which come from `specdec.rng.uniform` under
fixed keys); nothing here samples, patches the real code, or creates randomness.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.rng import Stream, uniform, uniform_to_gumbel, words_to_uniform32
from specdec.sampling import LogitsRules, process_logits

METHODS = ("standard", "block", "coupled")
DRAFT_KINDS = ("sampled", "one_hot")


@dataclass(frozen=True, slots=True)
class MarkovToy:
    """Bigram target and draft models: row a of a table holds the logits of the token after a.

    Attributes:
        target_logits: [V, V] float32 raw target logits.
        draft_logits: [V, V] float32 raw draft logits (same vocabulary).
        start_token: the last prompt token of every request.
    """

    target_logits: torch.Tensor
    draft_logits: torch.Tensor
    start_token: int = 0

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[-1]


def toy_logits(
    vocab_size: int, key: int, *, step: int, spread: float = 1.0, context_free: bool = False
) -> torch.Tensor:
    """[V, V] float32 logits: `spread` times keyed Gumbel noise, one row per previous token.

    The values come from `specdec.rng.uniform` (stream TARGET, seed `key`, position = row,
    `step`), so a table is a fixed function of its key. Context-free tables repeat row 0.
    """
    num_rows = 1 if context_free else vocab_size
    u = uniform(
        torch.full((num_rows,), key, dtype=torch.int64),
        torch.arange(num_rows),
        Stream.TARGET,
        vocab_size,
        step=step,
        dtype=torch.float64,
    )
    logits = (spread * uniform_to_gumbel(u)).to(torch.float32)
    return logits.expand(vocab_size, vocab_size).contiguous()


def markov_toy(
    vocab_size: int,
    key: int,
    *,
    draft: str = "near",
    context_free: bool = False,
    spread: float = 1.0,
) -> MarkovToy:
    """A toy model built from `key`.

    Args:
        vocab_size: V.
        key: table seed.
        draft: "near" (target plus keyed noise: a decent drafter), "adversarial" (-target: most
            drafts are rejected, so most requests reach the residual) or "independent".
        context_free: every row of both tables is the same (the law does not depend on context).
        spread: scale of the target logits (larger = more peaked).
    """
    target = toy_logits(vocab_size, key, step=0, spread=spread, context_free=context_free)
    if draft == "near":
        noise = toy_logits(vocab_size, key, step=1, spread=0.8, context_free=context_free)
        draft_logits = target + noise
    elif draft == "adversarial":
        draft_logits = -target
    elif draft == "independent":
        draft_logits = toy_logits(vocab_size, key, step=1, context_free=context_free)
    else:
        raise ValueError(f"draft must be 'near', 'adversarial' or 'independent', got {draft!r}")
    return MarkovToy(target, draft_logits)


@dataclass(frozen=True, slots=True)
class Processing:
    """Sampling parameters shared by the target and the drafter (None = filter off)."""

    name: str
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def kwargs(self) -> dict[str, float | int | None]:
        """The keyword arguments of `sample` and `verify`."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, V] raw logits -> [R, V] float32 processed logits, by `process_logits` itself
        (what `sample` returns as processed_logits and `verify` applies to the target)."""
        num_rows = logits.shape[0]

        def per_row(value: float | int | None) -> torch.Tensor | None:
            return None if value is None else torch.full((num_rows,), value)

        temperature = per_row(float(self.temperature)).float()
        return process_logits(
            logits, temperature, per_row(self.top_k), per_row(self.top_p), per_row(self.min_p)
        )


PROCESSINGS = (
    Processing("plain"),
    Processing("t0.7+top_k", 0.7, top_k=3),
    Processing("t0.7+top_p", 0.7, top_p=0.8),
    Processing("t0.7+min_p", 0.7, min_p=0.1),
)
GREEDY = Processing("greedy", 0.0)


def processed_probs(logits: torch.Tensor, processing: Processing) -> torch.Tensor:
    """[R, V] raw logits -> [R, V] float64 probabilities of what `sample` draws from.

    The processing is `specdec.sampling.process_logits` itself (what `sample` and `verify` run),
    and the softmax of its float32 output is taken in float64: the law Gumbel-max sampling on
    those logits has exactly. Greedy processing gives one-hot rows.
    """
    if processing.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    processed = processing.apply(logits)
    return processed.to(torch.float64).softmax(dim=-1)


def draft_probs(toy: MarkovToy, processing: Processing, drafts: str) -> torch.Tensor:
    """[V, V] float64 law of the draft after each token: processed ("sampled") or argmax."""
    return processed_probs(toy.draft_logits, GREEDY if drafts == "one_hot" else processing)


def joint_probs(target_probs: torch.Tensor, start_token: int, length: int) -> torch.Tensor:
    """Exact law of the first `length` tokens after `start_token` under a bigram table.

    Args:
        target_probs: [V, V] float64 transition probabilities.

    Returns:
        [V**length] float64, indexed by the base-V code of (x_1, ..., x_length), x_1 most
        significant (as `sequence_codes` encodes).
    """
    vocab = target_probs.shape[0]
    law = target_probs[start_token]
    for _ in range(length - 1):
        last = torch.arange(law.shape[0]) % vocab
        law = (law[:, None] * target_probs[last]).reshape(-1)
    return law


def sequence_codes(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] int64 tokens -> [N] int64 base-V codes (first token most significant)."""
    codes = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for column in tokens.unbind(dim=1):
        codes = codes * vocab_size + column
    return codes


def all_sequences(vocab_size: int, length: int) -> torch.Tensor:
    """[V**length, length] int64: every sequence, in `sequence_codes` order."""
    codes = torch.arange(vocab_size**length)
    powers = vocab_size ** torch.arange(length - 1, -1, -1)
    return codes[:, None] // powers % vocab_size


def standard_accept_ratios(
    target_rows: torch.Tensor, draft_rows: torch.Tensor, chains: torch.Tensor
) -> torch.Tensor:
    """Token-level acceptance probabilities min(1, target(x_i) / draft(x_i)) (Leviathan et al.).

    Args:
        target_rows: [P, >=K, V] float64: row i is the target law of the token at draft i.
        draft_rows: [P, K, V] float64: the draft law draft i was sampled from.
        chains: [P, K] int64 drafts.

    Returns:
        [P, K] float64 (1 where draft(x_i) = 0: such a chain has probability 0 anyway).
    """
    return _likelihood_ratios(target_rows, draft_rows, chains).clamp_max(1.0)


def _likelihood_ratios(target_rows, draft_rows, chains) -> torch.Tensor:
    at_target = target_rows[:, : chains.shape[1]].gather(-1, chains[..., None]).squeeze(-1)
    at_draft = draft_rows.gather(-1, chains[..., None]).squeeze(-1)
    safe = torch.where(at_draft > 0, at_draft, torch.ones_like(at_draft))
    return torch.where(at_draft > 0, at_target / safe, torch.ones_like(at_draft))


def block_accept_thresholds(
    target_rows: torch.Tensor, draft_rows: torch.Tensor, chains: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's weights and thresholds (Sun et al. 2024, Alg. 2), in float64.

    p_0 = 1, p_i = min(p_{i-1} target(x_i) / draft(x_i), 1); for 0 < i < K,
    h_i = S_i / (S_i + 1 - p_i) with S_i = sum_x max(p_i target_i(x) - draft_i(x), 0) over row
    i (the laws after x_1..x_i); h_K = p_K; h_0 = 1. Then tau = max{i : eta_i <= h_i}, and a
    rejected chain's token is drawn from max(p_tau target_tau - draft_tau, 0), renormalised.

    Args:
        target_rows: [P, K+1, V] float64 target laws along the chain (row i after x_1..x_i).
        draft_rows: [P, K, V] float64 draft laws along the chain.
        chains: [P, K] int64 drafts.

    Returns:
        (weights p [P, K+1], thresholds h [P, K+1]), float64.
    """
    num_chains, k = chains.shape
    ratios = _likelihood_ratios(target_rows, draft_rows, chains)
    weights = torch.ones(num_chains, k + 1, dtype=torch.float64)
    for i in range(1, k + 1):
        weights[:, i] = (weights[:, i - 1] * ratios[:, i - 1]).clamp_max(1.0)
    thresholds = torch.ones(num_chains, k + 1, dtype=torch.float64)
    for i in range(1, k):
        mass = (weights[:, i, None] * target_rows[:, i] - draft_rows[:, i]).clamp_min(0).sum(-1)
        below_one = weights[:, i] < 1
        ratio = mass / torch.where(below_one, mass + 1 - weights[:, i], torch.ones_like(mass))
        thresholds[:, i] = torch.where(below_one, ratio, torch.ones_like(mass))
    if k:
        thresholds[:, k] = weights[:, k]
    return weights, thresholds


def accepted_count_law(method: str, accept_probs: torch.Tensor) -> torch.Tensor:
    """P(num_accepted = i | chain) for i = 0..K.

    Args:
        method: "standard": accept_probs = [P, K] ratios, the chain stops at its first
            rejection. "block": accept_probs = [P, K+1] thresholds h, tau = max{i : eta_i <= h_i}.

    Returns:
        [P, K+1] float64.
    """
    ones = torch.ones(accept_probs.shape[0], 1, dtype=torch.float64)
    if method == "standard":
        survive = torch.cumprod(torch.cat([ones, accept_probs], dim=1), dim=1)
        return survive * torch.cat([1 - accept_probs, ones], dim=1)
    # P(tau = i) = h_i prod_{j > i} (1 - h_j)
    after = torch.cumprod((1 - accept_probs[:, 1:]).flip(1), dim=1).flip(1)  # prod_{j >= i+1}
    return accept_probs * torch.cat([after, ones], dim=1)


def coupled_match_probs(target_law: torch.Tensor, draft_law: torch.Tensor) -> torch.Tensor:
    """P(argmax(log target + G) = x = argmax(log draft + G)) for one shared Gumbel vector G.

    Equals 1 / sum_v max(target(v) / target(x), draft(v) / draft(x)), and 0 where either law is
    0: given G_x = t, every other lane must stay below t + min of the two log-ratios, and
    integrating over t gives the formula (the coupling of Daliri et al. 2024).

    Args:
        target_law, draft_law: [..., V] float64 probabilities.

    Returns:
        [..., V] float64.
    """
    both = (target_law > 0) & (draft_law > 0)
    target_safe = torch.where(both, target_law, torch.ones_like(target_law))
    draft_safe = torch.where(both, draft_law, torch.ones_like(draft_law))
    ratios = torch.maximum(
        target_law[..., None, :] / target_safe[..., :, None],
        draft_law[..., None, :] / draft_safe[..., :, None],
    )  # [..., x, v]
    return torch.where(both, 1 / ratios.sum(-1), torch.zeros_like(target_law))


def draft_chains(
    toy: MarkovToy, processing: Processing, drafts: str, num_draft: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draft chain of length K from the start token, with its probability.

    Returns:
        (chains [P, K] int64, chain_probs [P] float64): all V**K chains for sampled drafts
        (some of probability 0), the single greedy chain for one-hot drafts.
    """
    law = draft_probs(toy, processing, drafts)
    if drafts == "one_hot":
        chain, prev = [], toy.start_token
        for _ in range(num_draft):
            prev = int(law[prev].argmax())
            chain.append(prev)
        return torch.tensor(chain, dtype=torch.int64).view(1, num_draft), torch.ones(1).double()
    chains = all_sequences(toy.vocab_size, num_draft)
    context = torch.cat([torch.full((len(chains), 1), toy.start_token), chains], dim=1)
    return chains, law[context[:, :-1], context[:, 1:]].prod(dim=1)


def acceptance_law(
    toy: MarkovToy, processing: Processing, *, method: str, drafts: str, num_draft: int
) -> torch.Tensor:
    """[K+1] float64: the exact law of num_accepted in a request's first round."""
    target_law = processed_probs(toy.target_logits, processing)
    draft_law = draft_probs(toy, processing, drafts)
    if method == "coupled":
        # Drafts and target samples share each position's noise: match[a, x] is the
        # probability that both pick x after token a; positions draw independent noise.
        match = coupled_match_probs(target_law, draft_law)
        state = torch.nn.functional.one_hot(torch.tensor(toy.start_token), toy.vocab_size)
        survive = [state.to(torch.float64)]
        for _ in range(num_draft):
            survive.append(survive[-1] @ match)
        mass = torch.stack([s.sum() for s in survive] + [torch.zeros((), dtype=torch.float64)])
        return mass[:-1] - mass[1:]
    chains, chain_probs = draft_chains(toy, processing, drafts, num_draft)
    context = torch.cat([torch.full((len(chains), 1), toy.start_token), chains], dim=1)
    target_rows, draft_rows = target_law[context], draft_law[context[:, :-1]]
    if method == "standard":
        accept = standard_accept_ratios(target_rows, draft_rows, chains)
    else:
        accept = block_accept_thresholds(target_rows, draft_rows, chains)[1]
    return (chain_probs[:, None] * accepted_count_law(method, accept)).sum(0)


# ---------------------------------------------------------------------------------------------
# Penalties and bans: context-dependent processing
# ---------------------------------------------------------------------------------------------

# The rule sets of the penalty checks, over the V = 5 toy (every request's prompt is PROMPT).
RULE_SETS = {
    "penalties": LogitsRules(
        repetition_penalty=1.6,
        presence_penalty=0.9,
        frequency_penalty=0.7,
        logit_bias=((1, 0.8),),
    ),
    "bans": LogitsRules(
        allowed_token_ids=(0, 1, 2, 3),  # never 4
        bad_words_token_ids=((2, 1), (1, 1, 3)),  # no 1 after 2, no 3 after 1, 1
        min_tokens=2,
        min_tokens_banned=(0,),  # token 0 plays a stop token: banned for the first 2 tokens
        presence_penalty=-0.8,  # a negative penalty: repeats are favoured
    ),
}
PROMPT = (2, 0)  # ends with the toys' start token


def rules_logits_reference(
    logits: torch.Tensor, rules: LogitsRules, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row's logits after `rules`, written out token by token in float64 from vLLM's
    definitions (an independent twin of `specdec.sampling.LogitsContext.apply`).

    Args:
        logits: [V] raw logits of the token after `prompt + output`.

    Returns:
        [V] float64.
    """
    x = logits.to(torch.float64).clone()
    vocab = x.shape[0]
    neg_inf = float("-inf")
    if rules.allowed_token_ids is not None:
        for v in range(vocab):
            if v not in rules.allowed_token_ids:
                x[v] = neg_inf
    for word in rules.bad_words_token_ids:
        before = list(word[:-1])
        ends_with = len(output) >= len(before) and output[len(output) - len(before) :] == before
        if ends_with:
            x[word[-1]] = neg_inf
    if len(output) < rules.min_tokens:
        for v in rules.min_tokens_banned:
            x[v] = neg_inf
    for v, bias in rules.logit_bias:
        x[v] += bias
    for v in range(vocab):
        count = output.count(v)
        if count or v in prompt:
            p = rules.repetition_penalty
            x[v] = x[v] / p if x[v] > 0 else x[v] * p
        x[v] -= rules.frequency_penalty * count + rules.presence_penalty * (count > 0)
    if bool(torch.isneginf(x).all()):
        return logits.to(torch.float64)
    return x


def rules_joint_probs(
    toy: MarkovToy, processing: Processing, rules: LogitsRules, length: int
) -> torch.Tensor:
    """Exact law of the first `length` generated tokens after PROMPT under the bigram target
    with `rules` (penalties depend on the whole output, so every prefix is enumerated).

    Returns:
        [V**length] float64 in `sequence_codes` order.
    """
    vocab = toy.vocab_size
    prompt = list(PROMPT)
    law = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [[]]
    for _ in range(length):
        rows = torch.stack(
            [
                rules_logits_reference(
                    toy.target_logits[out[-1] if out else prompt[-1]], rules, prompt, out
                ).to(torch.float32)
                for out in prefixes
            ]
        )
        step = processed_probs(rows, processing)  # [P, V]
        law = (law[:, None] * step).reshape(-1)
        prefixes = [[*out, v] for out in prefixes for v in range(vocab)]
    return law


# ---------------------------------------------------------------------------------------------
# Structured outputs: a grammar constraint
# ---------------------------------------------------------------------------------------------

# A toy vocabulary of byte strings (the last one EOS) and a regex over it. Every string of the
# language has 13 repetitions or more, so EOS is never allowed within the 12 characters a
# checked sequence and its drafts reach; multi-character tokens straddle the repetitions.
GRAMMAR_TOKENS = (b"a", b"b", b"c", b"ab", b"bc", b"<eos>")
GRAMMAR_EOS = len(GRAMMAR_TOKENS) - 1
GRAMMAR_REGEX = "(a|bc|cab){13,}"
GRAMMAR_MIN_REPEATS = 13
# The regex's automaton, written out by hand (an independent twin of the grammar library):
# state -> character -> state; 0 is between repetitions.
_GRAMMAR_STATES = {0: {"a": 0, "b": 1, "c": 2}, 1: {"c": 0}, 2: {"a": 3}, 3: {"b": 0}}


def grammar_allowed_reference(
    output: list[int],
    tokens: tuple[bytes | None, ...] = GRAMMAR_TOKENS,
    eos_token_id: int = GRAMMAR_EOS,
) -> torch.Tensor:
    """[V] bool: the tokens `GRAMMAR_REGEX` allows after `output`, from the hand-written
    automaton: a token is allowed iff its characters keep the text a prefix of the language;
    EOS iff the text is in it.

    Args:
        output: token ids of `tokens`.
        tokens: the text of each token id (None: a special token, never allowed but EOS).
        eos_token_id: EOS's id.
    """
    state, repeats = 0, 0

    def run(state: int, repeats: int, text: str) -> tuple[int, int] | None:
        for char in text:
            state = _GRAMMAR_STATES[state].get(char)
            if state is None:
                return None
            repeats += state == 0
        return state, repeats

    for token in output:
        reached = None if tokens[token] is None else run(state, repeats, tokens[token].decode())
        if reached is None or token == eos_token_id:
            raise ValueError(f"output {output} is outside the language")
        state, repeats = reached
    allowed = torch.zeros(len(tokens), dtype=torch.bool)
    for token, text in enumerate(tokens):
        if text is not None and token != eos_token_id:
            allowed[token] = run(state, repeats, text.decode()) is not None
    allowed[eos_token_id] = state == 0 and repeats >= GRAMMAR_MIN_REPEATS
    return allowed


def grammar_joint_probs(toy: MarkovToy, processing: Processing, length: int) -> torch.Tensor:
    """Exact law of the first `length` generated tokens under the bigram target constrained by
    `GRAMMAR_REGEX`: norm(target x mask) at every position, the mask from
    `grammar_allowed_reference`, then `processing`.

    Returns:
        [V**length] float64 in `sequence_codes` order (0 outside the language).
    """
    vocab = toy.vocab_size
    law = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [[]]
    for _ in range(length):
        rows = []
        for out in prefixes:
            row = toy.target_logits[out[-1] if out else toy.start_token].clone()
            valid = all(grammar_allowed_reference(out[:i])[t] for i, t in enumerate(out))
            if valid:
                row[~grammar_allowed_reference(out)] = float("-inf")
            rows.append(row)
        step = processed_probs(torch.stack(rows), processing)  # [P, V]
        law = (law[:, None] * torch.nan_to_num(step)).reshape(-1)
        prefixes = [[*out, v] for out in prefixes for v in range(vocab)]
    return law


# ---------------------------------------------------------------------------------------------
# The far tail
# ---------------------------------------------------------------------------------------------

FAR_TAIL_GAP = 18.0  # logits between the head token and every tail token


def ideal_tail_mass(num_tail: int, gap: float = FAR_TAIL_GAP) -> float:
    """Mass of `num_tail` tokens `gap` logits below one head token: n e^-gap / (1 + n e^-gap)."""
    tail = num_tail * math.exp(-gap)
    return tail / (1 + tail)


def noise_tail_mass(
    word_to_noise: Callable[[torch.Tensor], torch.Tensor],
    num_tail: int,
    gap: float = FAR_TAIL_GAP,
    num_words: int = 2**21,
) -> float:
    """The exact tail mass that Gumbel-max sampling gets from a 32-bit word -> noise map.

    A tail token wins iff its noise exceeds the head's by `gap`. With Philox words uniform on
    [0, 2**32) and the map non-increasing in the word (small words give the largest noise),
    P(one lane's noise > s) = N(s) / 2**32, where N(s) counts the words mapped above s; only the
    `num_words` smallest words can matter. The head's noise is taken as exactly Gumbel (its own
    resolution moves the result by < 1e-9), so with intervals I_k of head noise on which
    N(noise + gap) = k: P(tail) = 1 - sum_k P(head in I_k) (1 - k / 2**32)**num_tail.

    Args:
        word_to_noise: [n] int64 words -> [n] float32 noise (e.g. `sampler_word_noise`).
    """
    noise = word_to_noise(torch.arange(num_words, dtype=torch.int64)).to(torch.float64)
    if bool((noise[1:] > noise[:-1]).any()):
        raise ValueError("word_to_noise must be non-increasing in the word")
    # N(t + gap) = k exactly for head noise t in I_k = [noise[k] - gap, noise[k-1] - gap).
    edges = torch.cat([torch.tensor([math.inf], dtype=torch.float64), noise - gap])
    head_cdf = torch.exp(-torch.exp(-edges))
    interval_mass = head_cdf[:-1] - head_cdf[1:]
    k = torch.arange(num_words, dtype=torch.float64)
    return 1.0 - float((interval_mass * torch.exp(num_tail * torch.log1p(-k / 2**32))).sum())


def sampler_word_noise(words: torch.Tensor) -> torch.Tensor:
    """The sampler's own word -> noise map: `uniform_to_gumbel(words_to_uniform32(words))`."""
    return uniform_to_gumbel(words_to_uniform32(words))
