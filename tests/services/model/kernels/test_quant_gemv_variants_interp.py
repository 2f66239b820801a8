"""The batch-1 GEMV variants behind knobs against quant_ref's dequantized weights, on the CPU through
Triton's interpreter: the grouped AWQ GEMV (quant_awq_gemv.awq_gemv_groups: zeros and scales out of the
inner product, 4-bit values as subnormal floats) in the one-row linear (quant_awq.linear with "groups"
tiles) and the one-token experts (gemv "groups"), and the pipelined FP8 GEMV (quant_fp8.GEMV_PIPELINED)
in both. Shapes not multiples of the tiles: K 300 (AWQ groups of 128, 128, 44), N 203 (a partial last
pack), D 160, F 72; the GPU is checked by test_quant_kernels_cuda.py.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
"""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.model.kernels import quant_ref as ref  # noqa: E402
from tests.triton_interpreter import interpreted_fixture  # noqa: E402

quant_awq = interpreted_fixture("kernels.quant_awq")
quant_awq_moe = interpreted_fixture("kernels.quant_awq_moe")
quant_fp8 = interpreted_fixture("kernels.quant_fp8")
quant_fp8_moe = interpreted_fixture("kernels.quant_fp8_moe")

K, N = 300, 203
E, D, F, TOP_K = 4, 160, 72, 2


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(scope="module")
def awq_weight():
    qweight, qzeros, scales = ref.quant_awq(_randn(K, N, seed=3))
    return qweight, qzeros, scales, ref.dequant_awq(qweight, qzeros, scales)


# x's scale: awq_gemv_groups multiplies x by 2^100 so that its products with subnormal nibbles stay
# normal floats; tiny and large activations check that range.
@pytest.mark.parametrize("x_scale", [1.0, 1e-6, 1e4])
@pytest.mark.parametrize("split_k", [1, 3])
def test_grouped_one_row_linear(quant_awq, awq_weight, split_k, x_scale):
    """4 column tiles of 64 (the last 11 columns wide), each split along K into whole groups (3 splits:
    one group each, awq_gemv_one_group); the last split of a tile sums them and sets its counter back
    to zero."""
    qweight, qzeros, scales, w_ref = awq_weight
    x = _randn(1, K, seed=4, scale=x_scale)
    tiles = quant_awq.AwqTiles(1, 64, 32, split_k, 4, 1, "groups")
    expected = x @ w_ref
    torch.testing.assert_close(quant_awq.linear(x, qweight, qzeros, scales, tiles=tiles), expected,
                               atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
    from services.model.kernels.quant_awq_gemv import split_counters
    assert not split_counters(torch.device("cpu"), 1, "one_row").any()


def test_grouped_one_row_is_the_same_bits_every_run(quant_awq, awq_weight):
    qweight, qzeros, scales, _ = awq_weight
    x = _randn(1, K, seed=5)
    tiles = quant_awq.AwqTiles(1, 64, 32, 3, 4, 1, "groups")
    first = quant_awq.linear(x, qweight, qzeros, scales, tiles=tiles)
    assert torch.equal(first, quant_awq.linear(x, qweight, qzeros, scales, tiles=tiles))


def test_default_one_row_tiles_follow_the_knob(quant_awq, monkeypatch):
    tiles = quant_awq.default_tiles(1, 5120, 2048)
    assert tiles.gemv == "groups" and tiles.block_m == 1 and 128 % tiles.block_k == 0
    # Qwen3-30B-A3B's q|k|v and o: one group a program (16 and 32 splits); Qwen3-235B-A22B's (2,304 and 2,048
    # programs at one group each): 256 columns a program, splits at least two groups deep.
    assert (tiles.block_n, tiles.block_k, tiles.split_k, tiles.warps) == (128, 16, 16, 2)
    assert quant_awq.default_tiles(1, 2048, 4096).split_k == 32
    big = quant_awq.default_tiles(1, 9216, 4096)
    assert (big.block_n, big.split_k, big.warps) == (256, 7, 4)
    assert quant_awq.default_tiles(1, 4096, 8192).split_k == 16
    assert quant_awq.default_tiles(16, 5120, 2048).gemv == "nibbles"
    monkeypatch.setattr(quant_awq, "ONE_ROW_GEMV", "nibbles")
    assert quant_awq.default_tiles(1, 5120, 2048).gemv == "nibbles"


def test_grouped_tiles_refuse_bad_values(quant_awq, quant_awq_moe):
    with pytest.raises(ValueError, match="'int4'"):
        quant_awq.AwqTiles(1, 64, 32, 1, 4, 1, "int4")
    with pytest.raises(ValueError, match="block_m 1"):
        quant_awq.AwqTiles(16, 64, 32, 1, 4, 1, "groups")
    with pytest.raises(ValueError, match="'rows'"):
        quant_awq_moe.OneTokenTiles(32, 64, 1, 4, 32, 64, 1, 4, gemv="rows")


def _one_token_reference(x, ids, weights, w_gate_up, w_down):
    """fp32: sum over k of weights[k] * (SiLU(x Wg) * (x Wu)) Wd of expert ids[k], AWQ's [K, N] weights dequantized."""
    wg = ref.dequant_awq(w_gate_up.qweight, w_gate_up.qzeros, w_gate_up.scales)
    wd = ref.dequant_awq(w_down.qweight, w_down.qzeros, w_down.scales)
    out = torch.zeros(1, D)
    for k in range(TOP_K):
        e = int(ids[0, k])
        gate_up = x @ wg[e]
        out += weights[0, k] * ((torch.nn.functional.silu(gate_up[:, :F]) * gate_up[:, F:]) @ wd[e])
    return out


@pytest.mark.parametrize("gate_up_splits", [1, 2])
def test_grouped_one_token_experts(quant_awq_moe, gate_up_splits):
    """gate_up: 2 column tiles of 64 a half (the last 8 wide), D's two groups (128, 32) in one program
    or two splits (one group each: awq_gemv_one_group); down: 3 column tiles (the last 32 wide), F's
    one partial group."""
    w_gate_up = quant_awq_moe.AwqWeights(*ref.quant_awq(_randn(E, D, 2 * F, seed=6, scale=D ** -0.5)))
    w_down = quant_awq_moe.AwqWeights(*ref.quant_awq(_randn(E, F, D, seed=7, scale=F ** -0.5)))
    x = _randn(1, D, seed=8)
    ids = torch.tensor([[2, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.7, 0.3]])
    tiles = quant_awq_moe.OneTokenTiles(gate_up_f=64, gate_up_d=32, gate_up_splits=gate_up_splits, gate_up_warps=4,
                                        down_o=64, down_f=32, down_splits=1, down_warps=4, gemv="groups")
    out = quant_awq_moe.one_token_experts(x, ids, weights, w_gate_up, w_down, tiles)
    torch.testing.assert_close(out, _one_token_reference(x, ids, weights, w_gate_up, w_down), atol=1e-5, rtol=1e-5)
    if gate_up_splits > 1:  # the splits summed in order: the same bits every run
        assert torch.equal(out, quant_awq_moe.one_token_experts(x, ids, weights, w_gate_up, w_down, tiles))
    assert not quant_awq_moe.split_counters(torch.device("cpu"), 1).any()


def test_pipelined_fp8_one_row_linear(quant_fp8, monkeypatch):
    """N 203, K 300: partial 128-blocks of scales at both edges; the same bits as the plain loop's."""
    w8, s = ref.quant_fp8(_randn(N, K, seed=9))
    x = _randn(1, K, seed=10)
    plain = quant_fp8.linear(x, w8, s, kernel="weight-only")
    monkeypatch.setattr(quant_fp8, "GEMV_PIPELINED", True)
    assert quant_fp8.gemv_stages(3) == 3
    pipelined = quant_fp8.linear(x, w8, s, kernel="weight-only")
    torch.testing.assert_close(pipelined, x @ ref.dequant_fp8(w8, s).T, atol=1e-5, rtol=1e-5)
    assert torch.equal(pipelined, plain)


def test_pipelined_fp8_one_token_experts(quant_fp8_moe, quant_fp8, monkeypatch):
    w = _randn(E, 2 * F, D, seed=11, scale=D ** -0.5)
    (g8, gs), (u8, us) = ref.quant_fp8(w[:, :F]), ref.quant_fp8(w[:, F:])  # each half blocked on its own
    d8, ds = ref.quant_fp8(_randn(E, D, F, seed=12, scale=F ** -0.5))
    x, ids, weights = _randn(1, D, seed=13), torch.tensor([[1, 3]], dtype=torch.int32), torch.tensor([[0.6, 0.4]])
    tiles = dataclasses.replace(quant_fp8_moe.ONE_TOKEN_TILES, gate_up_f=32, gate_up_d=64, down_o=64, down_f=64)
    monkeypatch.setattr(quant_fp8, "GEMV_PIPELINED", True)
    out = quant_fp8_moe.one_token_experts(x, ids, weights, torch.cat([g8, u8], 1), torch.cat([gs, us], 1), d8, ds,
                                          tiles)
    wg, wu, wd = ref.dequant_fp8(g8, gs), ref.dequant_fp8(u8, us), ref.dequant_fp8(d8, ds)
    expected = sum(weights[0, k] * ((torch.nn.functional.silu(x @ wg[e].T) * (x @ wu[e].T)) @ wd[e].T)
                   for k, e in enumerate(ids[0].tolist()))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
