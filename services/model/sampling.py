"""Choosing the next token from logits: greedy, or temperature, top-k, top-p and a draw.

A draw is keyed by the sequence's seed and the position of the token drawn:
its noise comes from a generator seeded with a hash of the two (splitmix64),
so a seed gives the same tokens whatever else shares the batch, and a
sequence resumed elsewhere (re-prefilled after a failover or a preemption)
draws what it would have drawn had it not moved. The rows that draw are
filtered and drawn together (one sort if any row filters): only the noise
is drawn row by row. The draw is the exponential race (argmax of p / E, E
~ Exp(1) per token), whose winner moves only if the logits move by about
its margin over the runner-up: robust to the rounding a different batch
gives (inverse transform sampling, one uniform per row, was tried and was
not: over a flat distribution of 151,936 tokens each token's slice of the
cumulative sum is ~1e-5 wide, and a re-prefill's rounding moved draws to
the neighbouring token). Nothing reads the device back but `sample`'s final
`.tolist()`. Legend: S sequences, D rows that draw, V vocab.

Hand-written: torch's generators are stateful, so one per sequence made a
sequence's draws depend on how many it had made on this rank: a resumed
sequence repeated its first ones.
"""

import threading

import torch
from torch import Tensor

from services.model.batch import to_device
from services.step import SamplingSpec


def sample(logits_SV: Tensor, specs: list[SamplingSpec], positions: list[int]) -> list[int]:
    """One token per row; positions[i] is the index in its sequence of the token row i draws."""
    # One host sync for the whole batch.
    return sample_on_device(logits_SV, specs, positions).tolist()


def sample_on_device(logits_SV: Tensor, specs: list[SamplingSpec], positions: list[int],
                     greedy_S: Tensor | None = None) -> Tensor:
    """sample without reading anything back: the int64 tokens [S] on logits' device.

    `greedy_S`, if given, is logits_SV.argmax(-1) computed already (e.g. inside
    a CUDA graph); the result is then greedy_S itself when every row is
    greedy, else a copy with the other rows drawn.
    """
    if not len(specs) == len(positions) == logits_SV.shape[0]:
        raise ValueError(f"{logits_SV.shape[0]} logit rows, {len(specs)} specs and {len(positions)} positions")
    tokens_S = logits_SV.argmax(dim=-1) if greedy_S is None else greedy_S
    drawn = [i for i, spec in enumerate(specs) if not spec.is_greedy]
    if not drawn:
        return tokens_S
    device = logits_SV.device
    rows_D = _to_device(drawn, torch.int64, device)
    logits_DV = logits_SV.index_select(0, rows_D).float()
    logits_DV /= _to_device([specs[i].temperature for i in drawn], torch.float32, device)[:, None]
    scores_DV, order_DV = _filtered_scores(logits_DV, [specs[i] for i in drawn])
    # The exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Each row's noise comes
    # from a generator seeded with the hash of (seed, position); clamped: log(0) would pick a
    # dropped token. One generator serves every row: each launch takes the seed it was set to.
    generator = _generator(device)
    noise_DV = torch.empty_like(scores_DV)
    for row, i in enumerate(drawn):
        generator.manual_seed(draw_seed(specs[i].seed, positions[i]))
        noise_DV[row].exponential_(generator=generator)
    picks_D = (scores_DV - noise_DV.clamp_(min=1e-30).log_()).argmax(dim=-1)
    if order_DV is not None:
        picks_D = order_DV.gather(1, picks_D[:, None])[:, 0]
    tokens_S = tokens_S.clone() if greedy_S is not None else tokens_S
    return tokens_S.index_copy_(0, rows_D, picks_D)


_MASK64 = (1 << 64) - 1
_LOCAL = threading.local()  # each thread's generators, one per device


def _mix64(z: int) -> int:
    """splitmix64's output function (Steele, Lea and Flood, 2014) on a 64-bit integer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The 64-bit seed of the draw of (seed, position)."""
    return _mix64((seed * 0x9E3779B97F4A7C15 + _mix64(position & _MASK64)) & _MASK64)


def _generator(device: torch.device) -> torch.Generator:
    """This thread's generator on `device`, which draws are seeded on."""
    generators = _LOCAL.__dict__.setdefault("generators", {})
    if device not in generators:
        generators[device] = torch.Generator(device=device)
    return generators[device]


def _filtered_scores(logits_DV: Tensor, specs: list[SamplingSpec]) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities up to a constant per row, -inf for the tokens top-k and then
    top-p drop; sorted by decreasing logit (with the order) if any row filters."""
    if not any(s.is_filtered for s in specs):
        return logits_DV, None
    device, vocab = logits_DV.device, logits_DV.shape[1]
    sorted_DV, order_DV = logits_DV.sort(dim=-1, descending=True)
    top_k_D1 = _to_device([s.top_k or vocab for s in specs], torch.int64, device)[:, None]
    keep_DV = torch.arange(vocab, device=device)[None, :] < top_k_D1
    probs_DV = torch.softmax(sorted_DV.masked_fill(~keep_DV, float("-inf")), dim=-1)
    # Drop a token once the tokens before it already reach top_p (the first always stays).
    top_p_D1 = _to_device([s.top_p for s in specs], torch.float32, device)[:, None]
    keep_DV &= probs_DV.cumsum(dim=-1) - probs_DV < top_p_D1
    return sorted_DV.masked_fill_(~keep_DV, float("-inf")), order_DV


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list on `device`, without a sync (pinned, non-blocking) on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)
