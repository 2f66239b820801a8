"""Sampling: greedy is argmax, draws keyed by (seed, position) whatever shares the batch, filters."""

import dataclasses

import pytest
import torch

from services.model.sampling import sample
from services.step import SamplingSpec

VOCAB = 64


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits_V, spec, steps=20, first=0) -> list[int]:
    """`steps` tokens drawn from the same logits by one sequence, at positions first, first + 1, ..."""
    return [sample(logits_V[None], [spec], [first + p])[0] for p in range(steps)]


def test_greedy_is_argmax():
    logits = _logits(5)
    specs = [SamplingSpec(temperature=0.0)] * 5
    assert sample(logits, specs, [0] * 5) == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_different_seeds_differ():
    logits_V = _logits(1)[0]
    spec = SamplingSpec(temperature=1.5, seed=42)
    assert _draws(logits_V, spec) == _draws(logits_V, spec)
    assert _draws(logits_V, spec) != _draws(logits_V, SamplingSpec(temperature=1.5, seed=43))


def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch():
    logits = _logits(4, seed=1)
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in (7, 8, 9, 10)]
    full = sample(logits, specs, [30, 31, 32, 33])
    alone = sample(logits[2:3], specs[2:3], [32])
    mixed = sample(logits[[0, 2]], [SamplingSpec(temperature=0.0), specs[2]], [0, 32])
    assert full[2] == alone[0] == mixed[1]


def test_a_draw_depends_on_the_seed_and_the_position_only():
    # A sequence resumed elsewhere (re-prefilled after a failover) draws what it would have.
    logits_V = _logits(1, seed=6)[0] / 4  # flat enough that most positions draw differently
    spec = SamplingSpec(temperature=1.0, seed=11)
    uninterrupted = _draws(logits_V, spec, steps=30, first=100)
    resumed = _draws(logits_V, spec, steps=10, first=120)
    assert resumed == uninterrupted[20:]
    assert len(set(uninterrupted)) > 5


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(6, seed=2)
    greedy = logits.argmax(dim=-1).tolist()
    for spec in (SamplingSpec(temperature=2.0, top_k=1, seed=3), SamplingSpec(temperature=2.0, top_p=1e-6, seed=3)):
        specs = [spec] * 6
        assert sample(logits, specs, list(range(6))) == greedy


def test_top_k_draws_only_from_the_k_most_likely():
    logits_V = _logits(1, seed=4)[0]
    allowed = set(logits_V.topk(3).indices.tolist())
    draws = _draws(logits_V, SamplingSpec(temperature=2.0, top_k=3, seed=5), steps=50)
    assert set(draws) <= allowed and len(set(draws)) > 1


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"temperature": 2.5}, {"temperature": float("nan")}, {"top_p": 0.0},
                                    {"top_p": 1.5}, {"top_k": -1}, {"seed": -1}, {"seed": 2**64}])
def test_rejects_bad_specs(kwargs):
    with pytest.raises(ValueError):
        SamplingSpec(**kwargs)


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-10])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    # Found by tests/e2e/test_fuzz_e2e.py: logits / 1e-45 overflowed to inf, the softmax
    # gave NaN and torch.multinomial raised, which failed the step and killed the rank.
    logits = _logits(3) * 100
    specs = [SamplingSpec(temperature=temperature, top_p=p, top_k=k, seed=1) for p, k in ((1.0, 0), (0.5, 0), (1.0, 5))]
    assert sample(logits, specs, [5, 6, 7]) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(("spec", "expected"), [
    (SamplingSpec(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
    (SamplingSpec(temperature=1.0, top_p=0.7), [0.625, 0.375, 0.0, 0.0]),  # the first two reach 0.7
    (SamplingSpec(temperature=1.0, top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
])
def test_draws_follow_the_filtered_distribution(spec, expected):
    # 4000 sequences with their own seeds, drawn in one batch beside greedy rows.
    num_rows = 4000
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(num_rows, 1)
    specs = [dataclasses.replace(spec, seed=i) if i % 4 else SamplingSpec(temperature=0.0) for i in range(num_rows)]
    tokens = sample(logits, specs, [0] * num_rows)
    drawn = torch.tensor([t for t, s in zip(tokens, specs) if not s.is_greedy])
    assert all(t == 0 for t, s in zip(tokens, specs) if s.is_greedy)
    frequencies = torch.bincount(drawn, minlength=4).float() / len(drawn)
    torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.03, rtol=0)


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_the_draw_seeds_are_uniform_along_seeds_and_positions(vary):
    from services.model.sampling import draw_seed

    seeds = [draw_seed(i, 7) if vary == "seed" else draw_seed(7, i) for i in range(20_000)]
    values = torch.tensor([(z >> 11) * 2.0 ** -53 for z in seeds], dtype=torch.float64)
    assert 0.0 <= float(values.min()) and float(values.max()) < 1.0
    counts = torch.histc(values, bins=10, min=0.0, max=1.0) / len(values)
    torch.testing.assert_close(counts, torch.full((10,), 0.1, dtype=torch.float64), atol=0.01, rtol=0)
    # Neighbours are not correlated (a hash, not a counter).
    assert abs(float(torch.corrcoef(torch.stack((values[:-1], values[1:])))[0, 1])) < 0.03


def test_one_sequences_draws_over_positions_follow_the_distribution():
    logits_V = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = _draws(logits_V, SamplingSpec(temperature=1.0, seed=123), steps=4000)
    frequencies = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)


def test_top_p_over_a_real_vocabulary_draws_only_the_nucleus():
    vocab = 151_936
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)) * 4
    specs = [SamplingSpec(temperature=1.0, top_p=0.5, seed=s) for s in range(4)]
    tokens = sample(logits, specs, [10] * 4)
    for row, token in enumerate(tokens):
        probs, order = torch.softmax(logits[row], dim=-1).sort(descending=True)
        nucleus = order[:int((probs.cumsum(0) - probs < 0.5).sum())]
        assert token in set(nucleus.tolist())
