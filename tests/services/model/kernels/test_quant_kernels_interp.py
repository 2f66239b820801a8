"""The FP8 and AWQ kernels (services/model/kernels/quant_*.py) against their pure-torch references
(quant_ref.py and the torch MoE layer on the dequantized weights), on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
fp32 activations (the interpreter's tl.dot reads bf16 as raw bits); odd shapes throughout:
N and K not multiples of 128 (partial scale blocks and groups at the edges), M = 1, 3, 16, 100.

The interpreter rounds fp32 to float8 wrongly where the rounding carries into an odd exponent
(124.4 becomes 64, not 128; docs/internals.md), so the fixture `exact_fp8_rounding` converts
through torch (round to nearest even, as the GPU's cvt.rn does) for the module's tests; the GPU
itself is checked by test_quant_kernels_cuda.py.
"""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.kernels import quant_ref as ref  # noqa: E402
from services.model.kernels.quant_select import select_quant_kernel  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from services.model.moe_dispatch import gate  # noqa: E402
from tests import triton_interpreter  # noqa: E402
from tests.triton_interpreter import interpreted_fixture  # noqa: E402

quant_fp8 = interpreted_fixture("kernels.quant_fp8")
quant_fp8_moe = interpreted_fixture("kernels.quant_fp8_moe")
quant_awq = interpreted_fixture("kernels.quant_awq")
quant_awq_moe = interpreted_fixture("kernels.quant_awq_moe")
moe_gemm = interpreted_fixture("kernels.moe_gemm")
routing = interpreted_fixture("kernels.routing")

N, K = 200, 300  # two and three 128-blocks, the last of each partial
E, D, F, TOP_K = 4, 160, 72, 2  # experts: D, F not multiples of 128 (F a multiple of 8, as AWQ packs)


@pytest.fixture(scope="module", autouse=True)
def exact_fp8_rounding():
    """fp32 -> float8_e4m3fn in the interpreter through torch (tests/triton_interpreter.py)."""
    with triton_interpreter.exact_fp8_rounding():
        yield


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _dequant_act(x):
    """x through quant_act_fp8 and back: what the FP8 tensor-core kernels multiply."""
    xq, xs = ref.quant_act_fp8(x)
    return xq.float() * xs.repeat_interleave(ref.FP8_BLOCK, 1)[:, :x.shape[1]]


def test_awq_pack_is_awqs_interleaved_order():
    """Nibble i of each int32 holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i] (AutoAWQ's pack loop);
    unpack inverts it, a partial last pack included."""
    q = torch.randint(0, 16, (5, 21), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    padded = torch.nn.functional.pad(q, (0, 3)).long()
    expected = torch.zeros(5, 3, dtype=torch.int64)
    for col in range(3):
        for i, c in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            expected[:, col] |= padded[:, 8 * col + c] << (4 * i)
    assert torch.equal(ref.awq_pack(q), torch.where(expected >= 2**31, expected - 2**32, expected).int())
    assert torch.equal(ref.awq_unpack(ref.awq_pack(q), 21), q)


@pytest.mark.parametrize(("capability", "requested", "expected"), [
    ((9, 0), "auto", "fp8"), ((8, 9), "auto", "fp8"), ((8, 0), "auto", "weight-only"),
    ((9, 0), "weight-only", "weight-only"), ((8, 0), "weight-only", "weight-only"), ((9, 0), "fp8", "fp8"),
    (None, "auto", "weight-only")])
def test_select_quant_kernel(capability, requested, expected):
    name, reason = select_quant_kernel(capability, requested)
    assert name == expected and reason


@pytest.mark.parametrize(("capability", "requested"), [((8, 0), "fp8"), (None, "fp8"), ((9, 0), "int4")])
def test_select_quant_kernel_refuses(capability, requested):
    with pytest.raises(ValueError, match="quantized-kernel"):
        select_quant_kernel(capability, requested)


def test_quantize_act_matches_the_reference(quant_fp8):
    """Per token and 128-channel group, the same codes and scales; a strided x, a zero group."""
    x = _randn(19, 320, seed=2, scale=30.0)[:, :K]
    x[3, 128:256] = 0.0
    xq, xs = quant_fp8.quantize_act(x)
    xq_ref, xs_ref = ref.quant_act_fp8(x)
    assert torch.equal(xs, xs_ref) and torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))


@pytest.fixture(scope="module")
def fp8_weight():
    w8, s = ref.quant_fp8(_randn(N, K, seed=3))
    return w8, s, ref.dequant_fp8(w8, s)


@pytest.mark.parametrize("num_rows", [1, 3, 16, 100])
def test_fp8_weight_only_linear(quant_fp8, fp8_weight, num_rows):
    w8, s, w_ref = fp8_weight
    x = _randn(num_rows, K, seed=num_rows)
    torch.testing.assert_close(quant_fp8.linear(x, w8, s, kernel="weight-only"), x @ w_ref.T, atol=1e-4, rtol=1e-5)


def test_fp8_one_row_long_rows_take_their_own_tiles(quant_fp8):
    """A row of LONG_ROW columns or more: the default GEMV reads it in steps of half LONG_ROW (a row of
    1.5 LONG_ROW: a whole step, then a partial one) with its block scales, as the reference."""
    k = 3 * quant_fp8.LONG_ROW // 2
    tiles = quant_fp8.default_tiles(1, 12, k, tensor_cores=False)
    assert (tiles.block_n, tiles.block_k) == (4, quant_fp8.LONG_ROW // 2)
    assert quant_fp8.default_tiles(1, 12, quant_fp8.LONG_ROW - 128, tensor_cores=False).block_k == 512
    w8, s = ref.quant_fp8(_randn(12, k, seed=8, scale=0.05))
    x = _randn(1, k, seed=9)
    torch.testing.assert_close(quant_fp8.linear(x, w8, s, kernel="weight-only"), x @ ref.dequant_fp8(w8, s).T,
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("num_rows", [1, 3])
def test_fp8_weight_only_from_raw_bytes(quant_fp8, num_rows):
    """Below compute capability 8.9 the weights go in as bytes: every finite e4m3 code (subnormals,
    both signs, 448) decodes to torch's value; split along K into fp32 partials."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    codes = codes[torch.randperm(256, generator=torch.Generator().manual_seed(4))]
    w8 = codes.repeat(9)[:8 * 260].reshape(8, 260).view(torch.float8_e4m3fn)
    s = torch.rand(1, 3, generator=torch.Generator().manual_seed(5)) + 0.5
    x = _randn(num_rows, 260, seed=6)
    tiles = quant_fp8.LinearTiles(num_rows if num_rows == 1 else 16, 8, 64, 2, 4, 1)
    y = quant_fp8.linear(x, w8, s, kernel="weight-only", tiles=tiles, native=False)
    torch.testing.assert_close(y, x @ ref.dequant_fp8(w8, s).T, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("split_k", [None, 2])
@pytest.mark.parametrize("num_rows", [20, 100])
def test_fp8_tensor_core_linear(quant_fp8, fp8_weight, num_rows, split_k):
    """The activations quantized per token and group, float8 products, fp32 sums: the default
    tiles (unsplit at these rows) and square tiles split along K (fp32 partials summed)."""
    w8, s, w_ref = fp8_weight
    x = _randn(num_rows, K, seed=7)
    expected = _dequant_act(x) @ w_ref.T
    tiles = None if split_k is None else quant_fp8.LinearTiles(64, 128, 128, split_k, 4, 1)
    if split_k is None:
        assert quant_fp8.default_tiles(num_rows, N, K, True).split_k == 1
    torch.testing.assert_close(quant_fp8.linear(x, w8, s, kernel="fp8", tiles=tiles), expected, atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def awq_weight():
    qweight, qzeros, scales = ref.quant_awq(_randn(K, N, seed=8))
    return qweight, qzeros, scales, ref.dequant_awq(qweight, qzeros, scales)


@pytest.mark.parametrize(("num_rows", "split_k"), [(1, None), (1, 1), (1, 3), (3, None), (16, 2), (100, None)])
def test_awq_linear(quant_awq, awq_weight, num_rows, split_k):
    """The default tiles and some split along K (fp32 partials summed after)."""
    qweight, qzeros, scales, w_ref = awq_weight
    x = _randn(num_rows, K, seed=num_rows)
    tiles = quant_awq.default_tiles(num_rows, N, K)
    if split_k:
        tiles = quant_awq.AwqTiles(tiles.block_m, tiles.block_n, tiles.block_k, split_k, tiles.warps, tiles.stages)
    torch.testing.assert_close(quant_awq.linear(x, qweight, qzeros, scales, tiles=tiles), x @ w_ref, atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("num_rows", [3, 16, 100])
def test_awq_linear_16bit_dots(quant_awq, awq_weight, num_rows):
    """16-bit activations take the biased tiles (awq_step_dot: 1024 + q and 1024 + z exact in fp16, their
    difference q - z); fp16 here, the interpreter's tl.dot reading bf16 as raw bits (the same code with
    bf16's constants runs in test_quant_kernels_cuda.py). Within fp16's rounding of x and of y."""
    qweight, qzeros, scales, w_ref = awq_weight
    x = _randn(num_rows, K, seed=num_rows).half()
    expected = x.float() @ w_ref
    y = quant_awq.linear(x, qweight, qzeros, scales)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), expected, atol=2e-3 * expected.abs().max().item(), rtol=0)


def test_awq_biased_dots_are_exact(quant_awq, awq_weight):
    """x = I (fp16): each output row is a row of W, (1024 + q - (1024 + z)) x s computed in fp32, so exactly
    the dequantized weight rounded once to fp16, every 4-bit value at every nibble of the packing."""
    qweight, qzeros, scales, w_ref = awq_weight
    y = quant_awq.linear(torch.eye(K, dtype=torch.float16), qweight, qzeros, scales)
    assert torch.equal(y, w_ref.half())


def test_awq_gemv_columns_past_the_last_multiple_of_8(quant_awq):
    """N = 203: qweight's last packed column holds 3 real columns (masked by column, not by packed
    column), K = 200 ends in a partial group, split along K (two splits of 128, the second partial)."""
    qweight, qzeros, scales = ref.quant_awq(_randn(200, 203, seed=21))
    x = _randn(1, 200, seed=22)
    tiles = quant_awq.AwqTiles(1, 16, 64, 3, 4, 1)
    torch.testing.assert_close(quant_awq.linear(x, qweight, qzeros, scales, tiles=tiles),
                               x @ ref.dequant_awq(qweight, qzeros, scales), atol=1e-4, rtol=1e-5)


def _moe_weights(seed=9):
    """Float expert weights [E, 2F, D] and [E, D, F] (MoELayer's layout) and the gate."""
    return (_randn(E, 2 * F, D, seed=seed, scale=D ** -0.5), _randn(E, D, F, seed=seed + 1, scale=F ** -0.5),
            _randn(E, D, seed=seed + 2))


def _moe_layer(w_gate_up, w_down, w_gate):
    return MoELayer(w_gate, w_gate_up, w_down, top_k=TOP_K, norm_topk_prob=True, comm=ExpertComm.local(),
                    hit_counts_E=torch.zeros(E, dtype=torch.int64))


@pytest.fixture(scope="module")
def fp8_experts():
    w_gate_up, w_down, w_gate = _moe_weights()
    (g8, gs), (u8, us) = ref.quant_fp8(w_gate_up[:, :F]), ref.quant_fp8(w_gate_up[:, F:])
    d8, ds = ref.quant_fp8(w_down)
    dequant = (torch.cat([ref.dequant_fp8(g8, gs), ref.dequant_fp8(u8, us)], 1), ref.dequant_fp8(d8, ds))
    return (torch.cat([g8, u8], 1), torch.cat([gs, us], 1), d8, ds), dequant, w_gate


# Small tiles, so that the GEMMs loop over several column tiles (F 72 in 32s, D 160 in 64s).
def _config(moe_gemm, block_m=16):
    return moe_gemm.MoEConfig(block_m, moe_gemm.GemmBlocks(32, 64, 4, 1), moe_gemm.GemmBlocks(64, 64, 4, 1))


def test_fp8_grouped_moe_weight_only(quant_fp8_moe, moe_gemm, fp8_experts):
    """19 tokens: two blocks of rows for some experts, the last partial."""
    (w_gate_up, s_gate_up, w_down, s_down), dequant, w_gate = fp8_experts
    layer = _moe_layer(*dequant, w_gate)
    x = _randn(19, D, seed=10)
    hits = torch.zeros(E, dtype=torch.int64)
    out = quant_fp8_moe.grouped_moe(x, w_gate, w_gate_up, s_gate_up, w_down, s_down, TOP_K, True, hits,
                                    _config(moe_gemm), kernel="weight-only")
    torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(hits, layer.hit_counts_E)


@pytest.mark.parametrize("block_n", [64, 256])
def test_fp8_gate_up_scales_past_the_first_block(quant_fp8_moe, moe_gemm, block_n):
    """An expert width of 200 (two 128-row scale blocks for gate and for up, the second partial):
    tiles within one block (64 columns: one scale a tile and step) and across blocks (256) read
    each column's block scales; SiLU(gate) * up against the dequantized weights."""
    width, tokens = 200, 12
    w_gate_up = _randn(E, 2 * width, D, seed=31, scale=D ** -0.5)
    w_gate_up[1, width + 130:] *= 8  # the up half's second block: scales unlike the first's
    (g8, gs), (u8, us) = ref.quant_fp8(w_gate_up[:, :width]), ref.quant_fp8(w_gate_up[:, width:])
    w_ref = torch.cat([ref.dequant_fp8(g8, gs), ref.dequant_fp8(u8, us)], 1)
    x = _randn(tokens, D, seed=32)
    ids = torch.arange(tokens * TOP_K, dtype=torch.int32).reshape(tokens, TOP_K) % E
    a = quant_fp8_moe.moe_align.align(ids, E, 16)
    act = quant_fp8_moe.gate_up(x, a, torch.cat([g8, u8], 1), torch.cat([gs, us], 1).contiguous(), TOP_K,
                                moe_gemm.GemmBlocks(block_n, 128, 4, 1), kernel="fp8")
    positions = [p for start, count in zip(a.starts_E.tolist(), a.counts_E.tolist())
                 for p in range(start, start + count)]  # the segments' rows, not their padding
    assert len(positions) == tokens * TOP_K
    for position in positions:
        routed = int(a.sorted_ids_P[position])
        t, e = routed // TOP_K, int(ids.flatten()[routed])
        gate_up = _dequant_act(x[t:t + 1]) @ w_ref[e].T
        expected = torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:]
        torch.testing.assert_close(act[position], expected[0], atol=2e-3, rtol=1e-3)


def test_fp8_grouped_moe_tensor_cores(quant_fp8_moe, moe_gemm, fp8_experts):
    """20 tokens (past WEIGHT_ONLY_MAX_ROWS): x and SiLU(gate) * up quantized per token and group."""
    (w_gate_up, s_gate_up, w_down, s_down), (w_gate_up_ref, w_down_ref), w_gate = fp8_experts
    x = _randn(20, D, seed=11)
    out = quant_fp8_moe.grouped_moe(x, w_gate, w_gate_up, s_gate_up, w_down, s_down, TOP_K, True,
                                    torch.zeros(E, dtype=torch.int64), _config(moe_gemm), kernel="fp8")
    ids, weights, _ = gate(x, w_gate, TOP_K, True)
    expected = torch.zeros_like(x)
    for t in range(20):
        for k in range(TOP_K):
            e = int(ids[t, k])
            gate_up = _dequant_act(x[t:t + 1]) @ w_gate_up_ref[e].T
            act = torch.nn.functional.silu(gate_up[:, :F]) * gate_up[:, F:]
            expected[t] += weights[t, k] * (_dequant_act(act) @ w_down_ref[e].T)[0]
    # The kernel's act differs from this one in fp32 summation order, which can move an element
    # across a float8 rounding boundary (one step: 1/16 of it).
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=1e-3)


def _sorted_rows_check(run, w_gate_up, w_down, quantize=None, tolerance=1e-5):
    """12 rows sorted by expert (experts 0, 1, 3; 2 has none) and 4 rows of capacity padding (NaN,
    never read): each row through its expert, as moe_experts.experts computes it (quantize: what the
    kernels multiply instead of x and act)."""
    quantize = quantize or (lambda v: v)
    x = torch.cat([_randn(12, D, seed=15), torch.full((4, D), float("nan"))])
    y = run(x, torch.tensor([5, 9, 9, 12], dtype=torch.int32))
    for row, e in enumerate([0] * 5 + [1] * 4 + [3] * 3):
        gate_up = quantize(x[row:row + 1]) @ w_gate_up[e].T
        expected = quantize(torch.nn.functional.silu(gate_up[:, :F]) * gate_up[:, F:]) @ w_down[e].T
        torch.testing.assert_close(y[row], expected[0], atol=tolerance, rtol=tolerance)


# "fp8" quantizes every row, the NaN padding too (its amax is NaN; the GEMMs never read it).
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize("kernel", ["weight-only", "fp8"])
def test_fp8_sorted_experts(quant_fp8_moe, moe_gemm, fp8_experts, kernel):
    """The dispatch path's rows; "fp8" quantizes x and act (its act may round to a neighbouring
    float8 value where the summation order differs, hence the looser tolerance)."""
    weights, (w_gate_up, w_down), _ = fp8_experts
    _sorted_rows_check(lambda x, offsets: quant_fp8_moe.sorted_experts(x, offsets, *weights, _config(moe_gemm),
                                                                       kernel=kernel),
                       w_gate_up, w_down, *((_dequant_act, 2e-3) if kernel == "fp8" else ()))


def test_awq_sorted_experts(quant_awq_moe, moe_gemm, awq_experts):
    w_gate_up, w_down, layer = awq_experts
    config = _config(moe_gemm)
    _sorted_rows_check(lambda x, offsets: quant_awq_moe.sorted_experts(x, offsets, w_gate_up, w_down, config),
                       layer.w_gate_up_LGD, layer.w_down_LDF)


def _one_token_check(module, routing, layer, run):
    """Tiles of fewer, wider programs than the defaults (the interpreter's time goes by programs),
    still looping over several column blocks and steps, the last of each partial."""
    x = _randn(1, D, seed=12)
    logits = torch.nn.functional.linear(x, layer.w_gate_ED)
    ids, weights, _ = routing.route(logits, TOP_K, True, torch.zeros(E, dtype=torch.int64), torch.float32)
    tiles = dataclasses.replace(module.ONE_TOKEN_TILES, gate_up_f=32, gate_up_d=64, down_o=64, down_f=64)
    torch.testing.assert_close(run(x, ids, weights, tiles), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])  # False: the weights as raw bytes (below sm89)
def test_fp8_one_token_experts(quant_fp8_moe, routing, fp8_experts, native):
    (w_gate_up, s_gate_up, w_down, s_down), dequant, w_gate = fp8_experts
    _one_token_check(quant_fp8_moe, routing, _moe_layer(*dequant, w_gate), lambda x, ids, weights, tiles:
                     quant_fp8_moe.one_token_experts(x, ids, weights, w_gate_up, s_gate_up, w_down, s_down, tiles,
                                                     native))


@pytest.fixture(scope="module")
def awq_experts(quant_awq_moe):
    w_gate_up, w_down, w_gate = _moe_weights(seed=13)
    w_gate_up = quant_awq_moe.AwqWeights(*ref.quant_awq(w_gate_up.transpose(1, 2)))  # AWQ stores [K, N]
    w_down = quant_awq_moe.AwqWeights(*ref.quant_awq(w_down.transpose(1, 2)))
    dequant = [ref.dequant_awq(w.qweight, w.qzeros, w.scales).transpose(1, 2).contiguous() for w in (w_gate_up, w_down)]
    return w_gate_up, w_down, _moe_layer(*dequant, w_gate)


# 16-row blocks put the weights first in the dots (quant_awq_moe.WEIGHTS_FIRST_MAX_ROWS), 64-row ones the rows.
@pytest.mark.parametrize("block_m", [16, 64])
def test_awq_grouped_moe(quant_awq_moe, moe_gemm, awq_experts, block_m):
    w_gate_up, w_down, layer = awq_experts
    x = _randn(19, D, seed=14)
    expected = layer(x)
    out = quant_awq_moe.grouped_moe(x, layer.w_gate_ED, w_gate_up, w_down, TOP_K, True,
                                    torch.zeros(E, dtype=torch.int64), _config(moe_gemm, block_m))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_awq_grouped_moe_16bit_dots(quant_awq_moe, moe_gemm, awq_experts, block_m):
    """fp16 activations: both GEMMs through the biased tiles (as test_awq_linear_16bit_dots), against the
    fp32 path's output, within fp16's rounding."""
    w_gate_up, w_down, layer = awq_experts
    x = _randn(19, D, seed=14)
    expected = layer(x.half().float())
    out = quant_awq_moe.grouped_moe(x.half(), layer.w_gate_ED.half(), w_gate_up, w_down, TOP_K, True,
                                    torch.zeros(E, dtype=torch.int64), _config(moe_gemm, block_m))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=3e-3 * expected.abs().max().item(), rtol=0)


def test_awq_one_token_experts(quant_awq_moe, routing, awq_experts):
    """Unsplit, and both kernels split along their reduction (gate_up 3 a half, down 2), the split counters left zero."""
    w_gate_up, w_down, layer = awq_experts
    for splits in ((1, 1), (3, 2)):
        _one_token_check(quant_awq_moe, routing, layer, lambda x, ids, weights, tiles, splits=splits:
                         quant_awq_moe.one_token_experts(x, ids, weights, w_gate_up, w_down, dataclasses.replace(
                             tiles, gate_up_splits=splits[0], down_splits=splits[1])))
    assert not quant_awq_moe.split_counters(torch.device("cpu"), 1).any()
