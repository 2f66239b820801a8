"""The FP8 and AWQ kernels (services/model/kernels/quant_*.py) compiled on a GPU, in bf16, against
their torch references (skipped without CUDA).

    python -m pytest -q tests/services/model/kernels/test_quant_kernels_cuda.py

Tolerances, and why:
- Linear layers, weight-only: float8 weights widen exactly to bf16 and AWQ's q - z is a small
  integer, so every product is exact in fp32 and the scales multiply fp32 sums; what is left is
  fp32 summation order (about 1e-6 relative at these K) and the bf16 output's rounding (at most
  2^-9 of the value): rtol 2^-8 with an atol for outputs near zero.
- FP8 tensor cores: the activations are compared with the reference quantization code for code
  (a GPU division may round a code the other way: at most 1 in 1,000 codes one step apart),
  then the GEMM against the reference on the kernel's own quantized activations, as above.
- The MoE (bf16 intermediates: gate, up, SiLU, act, each expert's output, rounded as the torch
  code rounds them): against the experts in fp32 on the dequantized weights (for the kernels'
  own routing: a near tie routed the other way would be a different sum), the quantized
  kernels' error is at most twice that of the bf16 kernels (moe_grouped.grouped_moe, or
  moe_small's one-token kernels, on the same weights rounded to bf16) plus 1e-3 of the output's
  scale. The FP8 tensor-core MoE also quantizes x and act (3 mantissa bits: each value within
  2^-4 of itself; about 4-5% mean error at the output): against the experts on unquantized
  activations, its mean error is at most 1.25 times that of the same quantization done in
  torch (fp32 intermediates) plus 2^-7 of the mean output (its bf16 intermediates, which also
  move some activations across a float8 rounding boundary).
"""

import pytest
import torch

from services.model.kernels import quant_ref as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
LINEAR_SHAPES = [(712, 1000), (5120, 2048)]  # (N, K): odd edges; Qwen3-30B-A3B's q|k|v
E, D, F, TOP_K = 16, 712, 200, 4  # experts: D, F not multiples of 128 (multiples of 8, as AWQ packs)


def _randn(*shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def _assert_linear_close(y, expected):
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("num_rows", [1, 3, 16, 100, 300])
@pytest.mark.parametrize("native", [True, False])
def test_fp8_weight_only_linear(shape, num_rows, native):
    from services.model.kernels import quant_fp8

    (n, k), x = shape, _randn(num_rows, shape[1], seed=num_rows, dtype=torch.bfloat16)
    w8, s = ref.quant_fp8(_randn(n, k, seed=1, scale=0.02))
    y = quant_fp8.linear(x, w8, s, kernel="weight-only", native=native)
    _assert_linear_close(y, x.float() @ ref.dequant_fp8(w8, s).T)


def test_quantize_act():
    from services.model.kernels import quant_fp8

    x = _randn(300, 1000, seed=2, scale=3.0, dtype=torch.bfloat16)
    xq, xs = quant_fp8.quantize_act(x)
    xq_ref, xs_ref = ref.quant_act_fp8(x)
    torch.testing.assert_close(xs, xs_ref, rtol=1e-6, atol=0)
    steps = (xq.float() - xq_ref.float()).abs() / xq_ref.float().abs().clamp(min=2**-6)
    assert steps.max() <= 2**-3 and (xq.view(torch.uint8) != xq_ref.view(torch.uint8)).float().mean() <= 1e-3


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("num_rows", [17, 100, 300, 4096])
def test_fp8_tensor_core_linear(shape, num_rows):
    from services.model.kernels import quant_fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    (n, k), x = shape, _randn(num_rows, shape[1], seed=3, dtype=torch.bfloat16)
    w8, s = ref.quant_fp8(_randn(n, k, seed=4, scale=0.02))
    xq, xs = quant_fp8.quantize_act(x)
    expected = (xq.float() * xs.repeat_interleave(ref.FP8_BLOCK, 1)[:, :k]) @ ref.dequant_fp8(w8, s).T
    _assert_linear_close(quant_fp8.linear(x, w8, s, kernel="fp8"), expected)


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("num_rows", [1, 3, 16, 100, 300])
def test_awq_linear(shape, num_rows):
    from services.model.kernels import quant_awq

    (n, k), x = shape, _randn(num_rows, shape[1], seed=num_rows, dtype=torch.bfloat16)
    qweight, qzeros, scales = ref.quant_awq(_randn(k, n, seed=5, scale=0.02))
    y = quant_awq.linear(x, qweight, qzeros, scales)
    _assert_linear_close(y, x.float() @ ref.dequant_awq(qweight, qzeros, scales))


def _moe_weights(seed):
    """Expert weights in MoELayer's layout ([E, 2F, D], [E, D, F]) and the gate."""
    return (_randn(E, 2 * F, D, seed=seed, scale=D ** -0.5), _randn(E, D, F, seed=seed + 1, scale=F ** -0.5),
            _randn(E, D, seed=seed + 2, scale=0.1))


def _dequant_act(x):
    """x through quant_act_fp8 and back: what the FP8 tensor-core kernels multiply."""
    xq, xs = ref.quant_act_fp8(x)
    return xq.float() * xs.repeat_interleave(ref.FP8_BLOCK, 1)[:, :x.shape[1]]


def _reference(x, ids, weights, w_gate_up, w_down, quantize=False):
    """The experts in fp32 (torch) on the dequantized weights, for the kernels' own routing;
    quantize: x and act quantized per token and group first, as the FP8 tensor-core kernels do."""
    out = torch.zeros(x.shape, device=DEVICE)
    q = _dequant_act if quantize else torch.Tensor.float
    for e in range(E):
        t, k = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            gate_up = q(x[t].float()) @ w_gate_up[e].T
            act = torch.nn.functional.silu(gate_up[:, :F]) * gate_up[:, F:]
            out.index_add_(0, t, weights[t, k].float()[:, None] * (q(act) @ w_down[e].T))
    return out


def _route(x, w_gate):
    """The grouped MoE's routing (the same kernels as inside grouped_moe)."""
    from services.model.kernels import moe_grouped

    return moe_grouped.route(x, w_gate, TOP_K, True, torch.zeros(E, dtype=torch.int64, device=DEVICE))[:2]


def _route_one(x, w_gate):
    from services.model.kernels import routing

    return routing.gate_route(x, w_gate, TOP_K, True, torch.zeros(E, dtype=torch.int64, device=DEVICE))[:2]


def _bf16_grouped(x, w_gate, w_gate_up, w_down):
    from services.model.kernels import moe_grouped

    return moe_grouped.grouped_moe(x, w_gate, w_gate_up.bfloat16(), w_down.bfloat16(), TOP_K, True,
                                   torch.zeros(E, dtype=torch.int64, device=DEVICE))


def _bf16_one_token(x, ids, weights, w_gate_up, w_down):
    from services.model.kernels import moe_small

    return moe_small.one_token_experts(x, ids, weights, w_gate_up.bfloat16(), w_down.bfloat16(),
                                       moe_small.ONE_TOKEN_MOE_TILES)


def _check_moe(out, expected, bf16):
    """out (bf16) against the fp32 reference: at most twice the bf16 path's error, plus 1e-3 of the scale."""
    bound = 2 * (bf16.float() - expected).abs().max().item() + 1e-3 * expected.abs().max().item()
    assert out.dtype == torch.bfloat16 and (out.float() - expected).abs().max().item() <= bound


@pytest.fixture(scope="module")
def fp8_experts():
    w_gate_up, w_down, w_gate = _moe_weights(seed=10)
    (g8, gs), (u8, us) = ref.quant_fp8(w_gate_up[:, :F]), ref.quant_fp8(w_gate_up[:, F:])
    d8, ds = ref.quant_fp8(w_down)
    dequant = (torch.cat([ref.dequant_fp8(g8, gs), ref.dequant_fp8(u8, us)], 1), ref.dequant_fp8(d8, ds))
    return (torch.cat([g8, u8], 1), torch.cat([gs, us], 1), d8, ds), dequant, w_gate.bfloat16()


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("native", [True, False])  # False: the weights as raw bytes (the path below sm89)
def test_fp8_grouped_moe_weight_only(fp8_experts, num_tokens, native):
    from services.model.kernels import quant_fp8_moe

    weights, dequant, w_gate = fp8_experts
    x = _randn(num_tokens, D, seed=11, dtype=torch.bfloat16)
    out = quant_fp8_moe.grouped_moe(x, w_gate, *weights, TOP_K, True,
                                    torch.zeros(E, dtype=torch.int64, device=DEVICE), kernel="weight-only",
                                    native=native)
    _check_moe(out, _reference(x, *_route(x, w_gate), *dequant), _bf16_grouped(x, w_gate, *dequant))


@pytest.mark.parametrize("num_tokens", [17, 64, 300, 4096])
def test_fp8_grouped_moe_tensor_cores(fp8_experts, num_tokens):
    from services.model.kernels import quant_fp8_moe

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    weights, dequant, w_gate = fp8_experts
    x = _randn(num_tokens, D, seed=12, dtype=torch.bfloat16)
    out = quant_fp8_moe.grouped_moe(x, w_gate, *weights, TOP_K, True,
                                    torch.zeros(E, dtype=torch.int64, device=DEVICE), kernel="fp8")
    ids, weights = _route(x, w_gate)
    expected = _reference(x, ids, weights, *dequant)
    quantized = _reference(x, ids, weights, *dequant, quantize=True)
    error, quantization_error = ((y.float() - expected).abs().mean() for y in (out, quantized))
    assert error <= 1.25 * quantization_error + 2**-7 * expected.abs().mean()


@pytest.mark.parametrize("native", [True, False])
def test_fp8_one_token_experts(fp8_experts, native):
    from services.model.kernels import quant_fp8_moe

    (w_gate_up, s_gate_up, w_down, s_down), dequant, w_gate = fp8_experts
    for seed in range(3):
        x = _randn(1, D, seed=20 + seed, dtype=torch.bfloat16)
        ids, weights = _route_one(x, w_gate)
        out = quant_fp8_moe.one_token_experts(x, ids, weights, w_gate_up, s_gate_up, w_down, s_down,
                                              native=native)
        _check_moe(out, _reference(x, ids, weights, *dequant), _bf16_one_token(x, ids, weights, *dequant))


@pytest.fixture(scope="module")
def awq_experts():
    from services.model.kernels.quant_awq_moe import AwqWeights

    w_gate_up, w_down, w_gate = _moe_weights(seed=30)
    quantized = [AwqWeights(*ref.quant_awq(w.transpose(1, 2))) for w in (w_gate_up, w_down)]  # AWQ stores [K, N]
    dequant = [ref.dequant_awq(w.qweight, w.qzeros, w.scales).transpose(1, 2).contiguous() for w in quantized]
    return quantized, dequant, w_gate.bfloat16()


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 64, 300, 4096])
def test_awq_grouped_moe(awq_experts, num_tokens):
    from services.model.kernels import quant_awq_moe

    (w_gate_up, w_down), dequant, w_gate = awq_experts
    x = _randn(num_tokens, D, seed=31, dtype=torch.bfloat16)
    out = quant_awq_moe.grouped_moe(x, w_gate, w_gate_up, w_down, TOP_K, True,
                                    torch.zeros(E, dtype=torch.int64, device=DEVICE))
    _check_moe(out, _reference(x, *_route(x, w_gate), *dequant), _bf16_grouped(x, w_gate, *dequant))


def test_awq_one_token_experts(awq_experts):
    from services.model.kernels import quant_awq_moe

    (w_gate_up, w_down), dequant, w_gate = awq_experts
    for seed in range(3):
        x = _randn(1, D, seed=40 + seed, dtype=torch.bfloat16)
        ids, weights = _route_one(x, w_gate)
        out = quant_awq_moe.one_token_experts(x, ids, weights, w_gate_up, w_down)
        _check_moe(out, _reference(x, ids, weights, *dequant), _bf16_one_token(x, ids, weights, *dequant))


def test_one_token_experts_capture_in_a_cuda_graph(fp8_experts, awq_experts):
    """Batch-1 decode replays a CUDA graph: both one-token paths capture, and replay to the eager bits."""
    from services.model.kernels import quant_awq_moe, quant_fp8_moe

    (w_gate_up, s_gate_up, w_down, s_down), _, w_gate = fp8_experts
    (awq_gate_up, awq_down), _, _ = awq_experts
    x = _randn(1, D, seed=50, dtype=torch.bfloat16)
    ids, weights = _route_one(x, w_gate)

    def step():
        return (quant_fp8_moe.one_token_experts(x, ids, weights, w_gate_up, s_gate_up, w_down, s_down),
                quant_awq_moe.one_token_experts(x, ids, weights, awq_gate_up, awq_down))

    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


@pytest.mark.parametrize("kind", ["fp8 weight-only", "fp8", "awq"])
def test_sorted_experts(fp8_experts, awq_experts, kind):
    """The dispatch path's rows, sorted by local expert (expert 2 has none) with 16 rows of capacity
    padding (NaN, never read): against each row through its expert, bounded as _check_moe (the
    tensor cores as test_fp8_grouped_moe_tensor_cores)."""
    from services.model.kernels import moe_gemm, quant_awq_moe, quant_fp8_moe

    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    counts = torch.tensor([37, 5, 0] + [23] * (E - 3), device=DEVICE)
    offsets, num_rows = counts.cumsum(0).int(), int(counts.sum())
    x = torch.cat([_randn(num_rows, D, seed=60, dtype=torch.bfloat16),
                   torch.full((16, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)])
    ids = torch.repeat_interleave(torch.arange(E, device=DEVICE), counts)[:, None]
    ones = torch.ones(num_rows, 1, device=DEVICE)
    if kind == "awq":
        (w_gate_up, w_down), dequant, _ = awq_experts
        out = quant_awq_moe.sorted_experts(x, offsets, w_gate_up, w_down)
    else:
        weights, dequant, _ = fp8_experts
        out = quant_fp8_moe.sorted_experts(x, offsets, *weights, kernel=kind.split()[-1])
    expected = _reference(x[:num_rows], ids, ones, *dequant)
    if kind == "fp8":
        quantized = _reference(x[:num_rows], ids, ones, *dequant, quantize=True)
        error, quantization_error = ((y.float() - expected).abs().mean() for y in (out[:num_rows], quantized))
        assert error <= 1.25 * quantization_error + 2**-7 * expected.abs().mean()
        return
    bf16 = moe_gemm.sorted_experts(x, offsets, dequant[0].bfloat16(), dequant[1].bfloat16())
    _check_moe(out[:num_rows], expected, bf16[:num_rows])


# The batch-1 GEMV variants behind knobs (not the defaults until measured): the grouped AWQ GEMV
# (quant_awq_gemv.awq_gemv_groups, whose 4-bit values are subnormal floats: this checks the GPU keeps
# subnormals, no flush to zero) and the pipelined FP8 GEMV, at the default's tolerances.
@pytest.mark.parametrize("shape", LINEAR_SHAPES + [(2048, 4096)])
def test_variant_awq_groups_linear(shape, monkeypatch):
    from services.model.kernels import quant_awq

    monkeypatch.setattr(quant_awq, "ONE_ROW_GEMV", "groups")
    (n, k), x = shape, _randn(1, shape[1], seed=1, dtype=torch.bfloat16)
    qweight, qzeros, scales = ref.quant_awq(_randn(k, n, seed=5, scale=0.02))
    y = quant_awq.linear(x, qweight, qzeros, scales)
    _assert_linear_close(y, x.float() @ ref.dequant_awq(qweight, qzeros, scales))
    assert torch.equal(y, quant_awq.linear(x, qweight, qzeros, scales))


def test_variant_awq_groups_one_token_experts(awq_experts):
    from services.model.kernels import quant_awq_moe

    (w_gate_up, w_down), dequant, w_gate = awq_experts
    for seed in range(3):
        x = _randn(1, D, seed=40 + seed, dtype=torch.bfloat16)
        ids, weights = _route_one(x, w_gate)
        out = quant_awq_moe.one_token_experts(x, ids, weights, w_gate_up, w_down, quant_awq_moe.GROUPED_TILES)
        _check_moe(out, _reference(x, ids, weights, *dequant), _bf16_one_token(x, ids, weights, *dequant))


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_variant_fp8_pipelined_gemv(shape, fp8_experts, monkeypatch):
    from services.model.kernels import quant_fp8, quant_fp8_moe

    monkeypatch.setattr(quant_fp8, "GEMV_PIPELINED", True)
    (n, k), x = shape, _randn(1, shape[1], seed=1, dtype=torch.bfloat16)
    w8, s = ref.quant_fp8(_randn(n, k, seed=1, scale=0.02))
    _assert_linear_close(quant_fp8.linear(x, w8, s, kernel="weight-only"), x.float() @ ref.dequant_fp8(w8, s).T)
    (w_gate_up, s_gate_up, w_down, s_down), dequant, w_gate = fp8_experts
    x = _randn(1, D, seed=20, dtype=torch.bfloat16)
    ids, weights = _route_one(x, w_gate)
    out = quant_fp8_moe.one_token_experts(x, ids, weights, w_gate_up, s_gate_up, w_down, s_down)
    _check_moe(out, _reference(x, ids, weights, *dequant), _bf16_one_token(x, ids, weights, *dequant))
