"""A quantized model through its CUDA wiring on the CPU, under Triton's interpreter (issue 29):
the registered linear kernels (kernels/quant_linear.py) in the fused layer loop
(kernels/fused_layer.py) and the quantized expert kernels of the "triton-quant" MoE backend
(kernels/quant_moe.py), against the CPU reference path (F.linear and the torch MoE on the
dequantized weights) of the same checkpoint.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
fp32 throughout (the interpreter's tl.dot reads bf16 as raw bits). The model is tiny-h160 cut to
two layers, an MoE layer then a dense one (every kernel of the loop, each residual add fused into
the next norm, the last into the final norm; more layers would only repeat them under the slow
interpreter): hidden 160 (FP8's edge blocks partial, AWQ groups of 32), q 128 rows and k, v 64
(FP8's q|k|v cannot be one weight: three projections; AWQ's is one).
"""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from services.kv_pool import KVPool  # noqa: E402
from services.model import qwen3_moe  # noqa: E402
from services.model.batch import SeqInput, build_decode_batch, build_forward_batch  # noqa: E402
from services.model.checkpoint import load_weights  # noqa: E402
from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.make_model import PRESETS, make_random_checkpoint  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from services.model.moe_backend import MoEBackend  # noqa: E402
from services.model.quant.experts import QuantExperts  # noqa: E402
from services.model.quant.dispatch import QuantPath  # noqa: E402
from services.model.quant.formats import QuantConfig  # noqa: E402
from services.model.quant.linear import QuantWeight  # noqa: E402
from tests import triton_interpreter  # noqa: E402
from tests.triton_interpreter import interpreted_fixture  # noqa: E402

quant_linear = interpreted_fixture("kernels.quant_linear")
quant_moe = interpreted_fixture("kernels.quant_moe")
fused_layer = interpreted_fixture("kernels.fused_layer")

SMALL = dataclasses.replace(PRESETS["tiny-h160"], vocab_size=256, eos_token_ids=(255,), num_hidden_layers=2)
QUANTS = {"fp8": QuantConfig("fp8"), "awq": QuantConfig("awq", group_size=32)}
TOKENS = torch.randint(256, (24,), generator=torch.Generator().manual_seed(3)).tolist()


def _weights(method, tmp_path_factory):
    root = tmp_path_factory.mktemp(method)
    make_random_checkpoint(root, SMALL, seed=7, with_tokenizer=False, quant=QUANTS[method])
    return load_weights(root, SMALL, range(SMALL.num_experts))


@pytest.fixture(scope="module", params=sorted(QUANTS))
def weights(request, tmp_path_factory):
    return _weights(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def fp8_weights(tmp_path_factory):
    return _weights("fp8", tmp_path_factory)


@pytest.fixture
def exact_fp8_rounding():
    """fp32 -> float8_e4m3fn in the interpreter through torch (tests/triton_interpreter.py)."""
    with triton_interpreter.exact_fp8_rounding():
        yield


class _Calls:
    """Wraps a kernel function, counting its calls."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, x_TK, weight):
        self.count += 1
        return self.fn(x_TK, weight)


def _kernel_model(weights, quant_linear, monkeypatch, path: str, **kwargs):
    """The model as CUDA builds it: every projection with its registered kernel (the path's)."""
    method = next(w.method for w in weights.values() if isinstance(w, QuantWeight))
    kernel = _Calls(quant_linear.awq_weight_only if method == "awq" else
                    quant_linear.fp8_tensor_cores if path == "fp8" else quant_linear.fp8_weight_only)
    with monkeypatch.context() as patch:
        patch.setattr(qwen3_moe, "choose_path", lambda requested, m, device: QuantPath(path, "test", kernel, False))
        model = qwen3_moe.Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts), **kwargs)
    return model, kernel


class _ForcedQuantMoE(MoEBackend):
    """quant_moe's kernel choice for CPU tensors (the backend itself keeps them on the torch path)."""

    def __init__(self, quant_moe, calls: list[str]):
        self.quant_moe, self.calls = quant_moe, calls

    def forward(self, layer, x_TD, capacity, add_norm):
        self.calls.append("one_rank" if self.quant_moe.one_rank(layer) else "dispatch")
        return self.quant_moe.quantized_moe(layer, x_TD, capacity, add_norm, gathers=False)


def _steps(model, pool, fused, monkeypatch, prefill: int, decode_rows=(1, 2)):
    """A prefill chunk of `prefill` tokens, then a decode step of each of decode_rows rows (one
    row: the GEMV and one-token kernels; two, one of them padding: the skinny and grouped ones);
    the logits of each."""
    batches = [build_forward_batch([SeqInput(0, TOKENS[:prefill], 0, [3, 1], True)], 16, "cpu")]
    batches += [build_decode_batch([SeqInput(0, [TOKENS[prefill + i]], prefill + i, [3, 1], True)], 16, "cpu",
                                   num_rows=rows, max_blocks=2) for i, rows in enumerate(decode_rows)]
    out = []
    for batch, capacity in zip(batches, (None, 2, 4)):
        with monkeypatch.context() as patch:
            if fused is not None:
                patch.setattr(qwen3_moe, "fused_kernels", lambda device: fused.fused_layer_kernels())
            out.append(model.forward_at_capacity(batch, pool, capacity))
    return out


def _pool():
    return KVPool.for_model(SMALL, 4, 16, torch.float32, "cpu")


# spares 0: the fused loop's kernels and the registered linear kernels with the one-rank expert kernels
# (one_token_experts, grouped_moe); 1: a spare slot per layer, the dispatch path's sorted_experts, the
# rest in torch (the linear kernels would only repeat 0's).
@pytest.mark.parametrize("spares", [0, 1])
def test_the_kernel_paths_give_the_reference_logits(weights, quant_linear, quant_moe, fused_layer, monkeypatch,
                                                    spares):
    reference = qwen3_moe.Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts),
                                        num_spare_expert_slots=spares)
    if spares:
        model = qwen3_moe.Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts),
                                        num_spare_expert_slots=spares)
    else:
        model, kernel = _kernel_model(weights, quant_linear, monkeypatch, "weight-only")
        layer = model.layers[0]
        method = layer.w_o_DHK.method
        # AWQ's q|k|v is one stored weight; FP8's k (64 rows) ends inside a 128-row block: three.
        assert (layer.w_qkv_XD is not None) == (method == "awq") and (layer.w_q_HKD is None) == (method == "awq")
    calls: list[str] = []
    for i in SMALL.moe_layers:
        model.layers[i].feed_forward.backend = _ForcedQuantMoE(quant_moe, calls)
    expected = _steps(reference, _pool(), None, monkeypatch, 7)
    got = _steps(model, _pool(), None if spares else fused_layer, monkeypatch, 7)
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert torch.equal(model.hit_counts_LE, reference.hit_counts_LE)
    if not spares:
        # Every projection through the registered kernel: 3 steps x (q|k|v as 1 or 3, o) x 2 layers, plus
        # the dense layer's gate, up and down.
        assert kernel.count == 3 * ((2 if method == "awq" else 4) * 2 + 3)
    assert calls == [("dispatch" if spares else "one_rank")] * (3 * len(SMALL.moe_layers))
    assert model.layers[0].feed_forward.quant_experts._dense is None  # never dequantized


def test_the_fp8_tensor_core_path(fp8_weights, quant_linear, quant_moe, fused_layer, monkeypatch, exact_fp8_rounding):
    """A prefill of 20 tokens (past WEIGHT_ONLY_MAX_ROWS): activations quantized per token and
    128-channel group; the decode step after it takes the weight-only kernels (on its K/V)."""
    weights = fp8_weights
    reference = qwen3_moe.Qwen3MoeModel(SMALL, weights, expert_ids=range(SMALL.num_experts))
    model, kernel = _kernel_model(weights, quant_linear, monkeypatch, "fp8")
    for i in SMALL.moe_layers:
        model.layers[i].feed_forward.backend = _ForcedQuantMoE(quant_moe, [])
    expected = _steps(reference, _pool(), None, monkeypatch, 20, decode_rows=(1,))
    got = _steps(model, _pool(), fused_layer, monkeypatch, 20, decode_rows=(1,))
    errors = [float((ours - theirs).abs().max() / theirs.abs().max()) for ours, theirs in zip(got, expected)]
    print("fp8 tensor-core path, max |logit error| / max |logit| per step:", errors)
    # float8 activations (3 mantissa bits) in the prefill and its K/V in the decode step's, through
    # two layers of a random model: about a tenth of the largest logit here (with four layers,
    # quant_ref's quant_act_fp8 before the attention and dense projections alone, in torch, gave 0.10
    # on this prefill). A wrong scale or layout is off by about the logits themselves.
    assert max(errors) < 0.3
    assert kernel.count > 0


@pytest.mark.parametrize("method", sorted(QUANTS))
def test_gathered_rows_through_the_quantized_expert_gemms(quant_moe, method):
    """Expert parallelism by gather (moe_ep.local_partials with the quantized GEMMs), two ranks
    simulated in one process: the sum of both ranks' partials is the one-rank torch layer's output
    on the dequantized weights."""
    tep, num_experts, hidden, width, top_k, tokens_N = quant_moe.moe_ep, 8, 64, 32, 2, [5, 3]
    g = torch.Generator().manual_seed(4)
    w_gate_ED = torch.randn(num_experts, hidden, generator=g)
    projections = [[QuantWeight.quantize(torch.randn(n, k, generator=g) * k ** -0.5, QUANTS[method])
                    for n, k in ((width, hidden), (width, hidden), (hidden, width))] for _ in range(num_experts)]
    dense_gate_up = torch.stack([torch.cat((gate.dequantize(), up.dequantize())) for gate, up, _ in projections])
    dense_down = torch.stack([down.dequantize() for _, _, down in projections])
    reference = MoELayer(w_gate_ED, dense_gate_up, dense_down, top_k=top_k, norm_topk_prob=True,
                         comm=ExpertComm.local(), hit_counts_E=torch.zeros(num_experts, dtype=torch.int64))
    rows_per_rank, num_local = max(tokens_N), num_experts // 2
    xs = [torch.randn(n, hidden, generator=g) for n in tokens_N]
    sends = []
    for x_TD in xs:
        ids_TK, weights_TK = quant_moe.routing.route(torch.nn.functional.linear(x_TD, w_gate_ED), top_k, True,
                                                     torch.zeros(num_experts, dtype=torch.int64), x_TD.dtype)[:2]
        sends.append(tep.pack(x_TD, ids_TK, weights_TK, rows_per_rank))
    recv_JW = torch.cat(sends)
    gemm = tep.moe_gemm
    config = gemm.MoEConfig(16, gemm.GemmBlocks(32, 32, 4, 1), gemm.GemmBlocks(32, 32, 4, 1))
    partials = []
    for rank in range(2):
        mine = projections[rank * num_local:(rank + 1) * num_local]
        stacks = [dataclasses.replace(QuantWeight.stack([p[i] for p in mine]), path="weight-only") for i in range(3)]
        experts = QuantExperts(*stacks, dtype=torch.float32, cache_dense=False)
        partials.append(tep.local_partials(recv_JW, hidden, top_k, 1 + rank * num_local, None, None, config,
                                           gemms=quant_moe.ExpertGemms(experts)))
    summed_JD = torch.stack(partials).sum(0)
    for rank, n in enumerate(tokens_N):
        torch.testing.assert_close(summed_JD[rank * rows_per_rank:][:n], reference(xs[rank]), atol=1e-4, rtol=1e-4)
