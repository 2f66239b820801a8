"""services/model/constraint_mask.py: forbidden tokens at -inf in the constrained rows only, other
rows untouched bit for bit, and greedy decoding over random logits through the masks ends inside
every constraint."""

import numpy as np
import pytest
import torch

from services.constraints import fill_masks
from services.model.constraint_mask import apply_token_bitmask_
from tests.services.constraint_cases import CONSTRAINTS, QWEN3_MODEL_VOCAB, check_output, qwen3, qwen3_compiler

VOCAB = 100   # 4 words, the last one partial


def _random_bitmask(num_rows: int, vocab: int, seed: int) -> np.ndarray:
    bits = np.random.default_rng(seed).random((num_rows, (vocab + 31) // 32 * 32)) < 0.3
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_forbidden_tokens_go_to_minus_inf_and_other_rows_keep_their_bits():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[4, 7] = float("nan")        # even a NaN in an unconstrained row stays as it was
    before = logits.clone()
    bitmask = _random_bitmask(2, VOCAB, seed=1)
    rows = [3, 1]
    assert apply_token_bitmask_(logits, bitmask, rows) is logits
    for c, row in enumerate(rows):
        allowed = torch.from_numpy(np.unpackbits(bitmask[c].view(np.uint8), bitorder="little")[:VOCAB]).bool()
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert bool((logits[row][~allowed] == float("-inf")).all())
    for row in (0, 2, 4):
        assert torch.equal(logits[row].view(torch.int32), before[row].view(torch.int32))


def test_no_constrained_rows_change_nothing_and_a_tensor_mask_works_too():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    apply_token_bitmask_(logits, np.zeros((0, 4), dtype=np.int32), [])
    assert torch.equal(logits, before)
    bitmask = _random_bitmask(1, VOCAB, seed=3)
    expected = apply_token_bitmask_(logits.clone(), bitmask, [2])
    assert torch.equal(apply_token_bitmask_(logits, torch.from_numpy(bitmask), [2]), expected)


@pytest.mark.parametrize("bitmask", [np.zeros((1, 3), dtype=np.int32), np.zeros((1, 4), dtype=np.int64)])
def test_a_mask_of_another_width_or_type_is_refused(bitmask):
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(torch.zeros(2, VOCAB), bitmask, [0])


def test_greedy_over_random_logits_through_the_masks_ends_inside_every_constraint():
    """One batch: every constraint kind and an unconstrained row, greedy over fresh random logits
    each step, the masks filled together (fill_masks) and applied on the logits."""
    compiler, eos = qwen3_compiler(), set(qwen3().eos_token_ids)
    names = ["ticket", "nested", "regex", "grammar", "choice"]
    matchers = [compiler.matcher(CONSTRAINTS[name]) for name in names]
    outputs: list[list[int]] = [[] for _ in names]
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        live = [c for c, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        bitmask = np.zeros((len(live), compiler.mask_words), dtype=np.int32)
        fill_masks(bitmask, [matchers[c] for c in live])
        logits = torch.randn(len(live) + 1, QWEN3_MODEL_VOCAB, generator=generator)
        free_row = logits[-1].clone()
        apply_token_bitmask_(logits, bitmask, range(len(live)))
        assert torch.equal(logits[-1], free_row)
        for row, token in zip(live, logits.argmax(dim=-1)[:-1].tolist()):
            assert matchers[row].accept(token)
            outputs[row].append(token)
    for name, tokens in zip(names, outputs):
        assert tokens and tokens[-1] in eos, (name, qwen3().decode(tokens))
        check_output(name, qwen3().decode(tokens[:-1]))
