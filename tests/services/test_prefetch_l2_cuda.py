"""triton_fused.prefetch_l2 on one GPU (skipped without a Hopper GPU: single-token steps use PDL).

A prefetch only asks L2 to fetch lines, so a single-token chain with it must give the bits the
chain without it gives: the one-token MoE with its experts' down weights prefetched (the ids
form, between gate_route and gate_up), and a GEMV behind a prefetch of its weight (the whole-
tensor form), each way (per-line and bulk prefetches, loads), on the side stream joined
after. A tail that is not a whole chunk is refused.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper GPU (PDL)")

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8


@pytest.fixture
def fused(monkeypatch):
    from services.model import triton_fused

    monkeypatch.setattr(triton_fused, "PDL", True)
    monkeypatch.setattr(triton_fused, "SINGLE_TOKEN_KERNELS", True)
    return triton_fused


def _moe(fused, x, w_gate, w_gate_up, w_down):
    hits = torch.zeros(NUM_EXPERTS, dtype=torch.int32, device="cuda")
    return fused.fused_moe(x, w_gate, w_gate_up, w_down, TOP_K, True, hits), hits


@pytest.mark.parametrize("how", ["line", "bulk", "load"])
def test_prefetching_changes_no_bit(fused, monkeypatch, how):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen).bfloat16()
    w_gate = torch.randn(NUM_EXPERTS, HIDDEN, device="cuda", generator=gen).bfloat16() * 0.05
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", generator=gen).bfloat16() * 0.02
    w_down = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, device="cuda", generator=gen).bfloat16() * 0.02
    w_o = torch.randn(HIDDEN, 4096, device="cuda", generator=gen).bfloat16() * 0.02
    h = torch.randn(1, 4096, device="cuda", generator=gen).bfloat16()
    monkeypatch.setattr(fused, "L2_PREFETCH", ())
    plain, plain_hits = _moe(fused, x, w_gate, w_gate_up, w_down)
    plain_o = fused.linear(h, w_o)
    monkeypatch.setattr(fused, "L2_PREFETCH", ("down",))
    monkeypatch.setattr(fused, "L2_PREFETCH_HOW", how)
    assert fused.prefetches("down", x) and not fused.prefetches("o", x)
    assert not fused.prefetches("down", torch.zeros(2, HIDDEN, device="cuda"))  # a step of 2: no PDL
    prefetched, hits = _moe(fused, x, w_gate, w_gate_up, w_down)
    fused.prefetch_l2(w_o)
    prefetched_o = fused.linear(h, w_o)
    fused.join_prefetches(x.device)
    assert not fused._PREFETCH_PENDING
    torch.cuda.synchronize()
    assert torch.equal(prefetched, plain) and torch.equal(hits, plain_hits)
    assert torch.equal(prefetched_o, plain_o)


def test_a_row_of_a_partial_chunk_is_refused(fused, monkeypatch):
    monkeypatch.setattr(fused, "L2_PREFETCH_HOW", "line")
    with pytest.raises(AssertionError, match="whole chunks"):
        fused.prefetch_l2(torch.zeros(3, 10, dtype=torch.bfloat16, device="cuda"))
