"""Choosing the next token from logits: greedy, or temperature, top-k, top-p and a draw.

Each sequence draws from its own torch.Generator, seeded from its spec, so a
seed gives the same tokens whatever else shares the batch. Legend: S sequences,
V vocab.
"""

import dataclasses

import torch
from torch import Tensor

# Temperatures below it sample greedily (as vLLM does): dividing the logits by
# a subnormal temperature overflows them to inf and the softmax to NaN, and at
# such a temperature every token but the argmax has a probability of ~0 anyway.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How one sequence samples."""

    # 0 (or below MIN_TEMPERATURE) means greedy (argmax); otherwise the logits are divided by it.
    temperature: float = 1.0
    # Keep the smallest set of most likely tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Keep the top_k most likely tokens; 0 keeps all.
    top_k: int = 0
    # Seeds the sequence's own torch.Generator (the caller keeps it across steps).
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must not be negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must not be negative (0 keeps all), got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        """True if sampling is argmax."""
        return self.temperature < MIN_TEMPERATURE


def sample(logits_SV: Tensor, specs: list[SamplingSpec],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row; generators[i] (on logits' device) is used only if row i is not greedy."""
    if not len(specs) == len(generators) == logits_SV.shape[0]:
        raise ValueError(
            f"{logits_SV.shape[0]} logit rows, {len(specs)} specs and {len(generators)} generators"
        )
    tokens_S = logits_SV.argmax(dim=-1)
    for i, spec in enumerate(specs):
        if not spec.is_greedy:
            probs_V = _filtered_probs(logits_SV[i].float() / spec.temperature, spec.top_k, spec.top_p)
            tokens_S[i] = torch.multinomial(probs_V, 1, generator=generators[i])[0]
    # One host sync for the whole batch.
    return tokens_S.tolist()


def _filtered_probs(logits_V: Tensor, top_k: int, top_p: float) -> Tensor:
    """Softmax over the tokens that survive top-k, then top-p; the rest get 0."""
    sorted_V, order_V = logits_V.sort(descending=True)
    keep_V = torch.ones_like(sorted_V, dtype=torch.bool)
    if top_k:
        keep_V[top_k:] = False
    probs_V = torch.softmax(sorted_V.masked_fill(~keep_V, float("-inf")), dim=-1)
    # Drop a token once the tokens before it already reach top_p (the first always stays).
    mass_before_V = probs_V.cumsum(dim=-1) - probs_V
    keep_V &= mass_before_V < top_p
    probs_V = torch.softmax(sorted_V.masked_fill(~keep_V, float("-inf")), dim=-1)
    return torch.zeros_like(probs_V).scatter_(0, order_V, probs_V)
