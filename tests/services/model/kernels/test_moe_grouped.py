"""The one-rank grouped MoE and its pieces (services/model/kernels/moe_align.py, moe_gemm.py,
moe_grouped.py) against the torch MoE layer, on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined, so this file sets it first.
fp32 (the model's CPU dtype) and fp16 (rounded by the interpreter as a GPU rounds it); bf16 on
the GPU is checked by the benchmarks.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from services.model.exchange.comm import ExpertComm  # noqa: E402
from services.model.layers import AddNorm, rms_norm  # noqa: E402
from services.model.moe import MoELayer  # noqa: E402
from services.model.moe_dispatch import combine, dispatch, gate, step_capacity  # noqa: E402
from services.model.moe_experts import experts  # noqa: E402
from tests.triton_interpreter import interpreted_fixture  # noqa: E402


# The kernel modules, each imported under the interpreter (or the test skipped without triton).
moe_align = interpreted_fixture("kernels.moe_align")
moe_gemm = interpreted_fixture("kernels.moe_gemm")
moe_grouped = interpreted_fixture("kernels.moe_grouped")
moe_triton = interpreted_fixture("kernels.moe_triton")
norm = interpreted_fixture("kernels.norm")


def _routed_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Each token's top_k distinct experts in increasing order, as route gives them."""
    generator = torch.Generator().manual_seed(seed)
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator)
    return scores_TE.topk(top_k, dim=1).indices.sort(dim=1).values


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 130, 1100])
@pytest.mark.parametrize("block_m", [1, 16])
def test_align_groups_rows_by_expert(moe_align, num_tokens, block_m):
    """Segments padded to block_m in expert order, rows in increasing r within one (130 tokens:
    several align chunks; 1100: more chunks than the place kernel reads at once), and pos_R the
    inverse of sorted_ids_P."""
    num_experts, top_k = 12, 3
    ids_TK = _routed_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    a = moe_align.align(ids_TK, num_experts, block_m)
    counts_E = torch.bincount(ids_TK.flatten(), minlength=num_experts)
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    assert torch.equal(a.counts_E.long(), counts_E)
    assert torch.equal(a.ends_E.long(), padded_E.cumsum(0))
    assert torch.equal(a.starts_E.long(), padded_E.cumsum(0) - padded_E)
    assert a.sorted_ids_P.shape[0] >= int(padded_E.sum())
    for expert in range(num_experts):
        start, count = int(a.starts_E[expert]), int(counts_E[expert])
        rows = (ids_TK.flatten() == expert).nonzero().flatten()
        assert torch.equal(a.sorted_ids_P[start:start + count].long(), rows)
    assert torch.equal(a.sorted_ids_P[a.pos_R.long()].long(), torch.arange(num_tokens * top_k))


def _moe_layer(hidden: int, width: int, dtype=torch.float32, num_experts=8, top_k=3, seed=9,
               backend="auto") -> MoELayer:
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * width, hidden, generator=generator) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, width, generator=generator) / width ** 0.5
    w_gate = torch.randn(num_experts, hidden, generator=generator)
    return MoELayer(w_gate.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), top_k=top_k, norm_topk_prob=True,
                    comm=ExpertComm.local(), hit_counts_E=torch.zeros(num_experts, dtype=torch.int64), backend=backend)


def _reference(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch layer's output and hit counts, in fixed-capacity mode as the model picks it."""
    capacity = step_capacity(x_TD.shape[0], layer.top_k, layer.w_gate_ED.shape[0], 256)
    out_TD = layer(x_TD, capacity)
    return out_TD, layer.hit_counts_E.clone()


# Small tiles (the interpreter is slow) that still split D and F: uneven shapes take the masked
# loads, even ones (D, F multiples of block_k) the unmasked ones.
def _config(moe_gemm, block_m=16, gate_up=(16, 16, 4, 2), down=(32, 16, 4, 2)):
    return moe_gemm.MoEConfig(block_m, moe_gemm.GemmBlocks(*gate_up), moe_gemm.GemmBlocks(*down))


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33, 70])
@pytest.mark.parametrize("shape", [(48, 40), (64, 32)])
@pytest.mark.parametrize("gemms", ["triton", "torch"])
def test_grouped_moe_matches_moe_layer(moe_gemm, moe_grouped, num_tokens, shape, gemms):
    hidden, width = shape
    layer = _moe_layer(hidden, width)
    x_TD = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    expected_TD, expected_hits_E = _reference(layer, x_TD)
    hits_E = torch.full((8,), 3, dtype=torch.int64)
    out_TD = moe_grouped.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits_E,
                              config=_config(moe_gemm), gemms=gemms)
    assert out_TD.shape == (num_tokens, hidden)
    torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)
    assert torch.equal(hits_E - 3, expected_hits_E) and int(expected_hits_E.sum()) == num_tokens * 3


def test_tiles_first_grid(moe_gemm, moe_grouped):
    """The GEMMs' grid with the column tiles as its first axis (tiles_first): the same bits;
    default_config launches so at every step size, and so does a MoEConfig built without the flag."""
    layer = _moe_layer(48, 40)
    x_TD = torch.randn(33, 48, generator=torch.Generator().manual_seed(3))
    args = (x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True)
    outputs = [moe_grouped.grouped_moe(*args, torch.zeros(8, dtype=torch.int64), config=dataclasses.replace(
        _config(moe_gemm), tiles_first=tiles_first)) for tiles_first in (False, True)]
    assert torch.equal(outputs[0], outputs[1])
    assert all(moe_gemm.default_config(t).tiles_first for t in (1, 256, 512, 513, 8192))
    assert _config(moe_gemm).tiles_first


def test_routed_ids_route_as_the_grouped_layer(moe_triton, monkeypatch):
    """MoELayer.routed_ids (the CUDA graph runner's probe of a padding row) routes a row as the
    layer's grouped kernels do (gate_route_rows), here forced on the CPU: the last row's experts
    are what the layer's step over every row counts beyond its step over the others."""
    monkeypatch.setattr(moe_triton.TritonMoE, "_takes_grouped_moe", lambda self, layer, x_TD: True)
    layer = _moe_layer(48, 40, backend="triton")
    x_TD = torch.randn(21, 48, generator=torch.Generator().manual_seed(6))
    counted = []
    for rows in (x_TD, x_TD[:-1]):
        before = layer.hit_counts_E.clone()
        layer(rows.contiguous())
        counted.append(layer.hit_counts_E - before)
    before = layer.hit_counts_E.clone()
    ids_K = layer.routed_ids(x_TD)[-1]
    assert torch.equal(layer.hit_counts_E, before)  # not counted
    assert torch.equal(torch.bincount(ids_K, minlength=8), counted[0] - counted[1])


def test_default_config_runs(moe_grouped):
    """The GPU's tiles (block_m 32, wide blocks past D and F) on a small odd batch."""
    layer = _moe_layer(48, 40)
    x_TD = torch.randn(37, 48, generator=torch.Generator().manual_seed(2))
    expected_TD, _ = _reference(layer, x_TD)
    out_TD = moe_grouped.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True,
                              torch.zeros(8, dtype=torch.int64))
    torch.testing.assert_close(out_TD, expected_TD, atol=1e-5, rtol=1e-5)


def test_half_precision_rounds_like_torch(moe_gemm, moe_grouped):
    """fp16: every intermediate rounded as the torch layer rounds it. Products of an exact fp32 sum agree
    to the bit, or differ where the reduction order does: an intermediate of one token one unit
    off (the CPU's matmul sums in another order: on an AVX2-only EPYC one token's outputs were up
    to 4 units off, all other elements within 1), which stays in that token's row. A skipped
    rounding of gate, SiLU or a weighted output leaves 27-52% of the elements unequal and puts
    elements more than one unit off in 9-21 of the 21 rows."""
    layer = _moe_layer(64, 32, dtype=torch.float16)
    x_TD = torch.randn(21, 64, generator=torch.Generator().manual_seed(4)).half()
    expected_TD, expected_hits_E = _reference(layer, x_TD)
    hits_E = torch.zeros(8, dtype=torch.int64)
    out_TD = moe_grouped.grouped_moe(x_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True, hits_E,
                              config=_config(moe_gemm))
    units_TD = (out_TD.view(torch.int16).int() - expected_TD.view(torch.int16).int()).abs()  # same signs: ulps
    assert torch.equal(hits_E, expected_hits_E)
    assert (out_TD == expected_TD).float().mean() > 0.95
    assert (units_TD > 1).any(1).sum() <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 21])
def test_combine_adds_and_norms_like_add_rms_norm(moe_gemm, moe_grouped, norm, monkeypatch, dtype, num_tokens):
    """grouped_moe given an AddNorm: the combine kernel adds the output into the residual stream
    and takes the next RMSNorm; the same bits as the combine kernel, then add_rms_norm_, and in
    fp16 as the torch add and rms_norm (hidden 48: the row's block partly masked)."""
    layer = _moe_layer(48, 40, dtype=dtype)
    generator = torch.Generator().manual_seed(7)
    x_TD, h_TD = (torch.randn(num_tokens, 48, generator=generator).to(dtype) for _ in range(2))
    norm_D = torch.randn(48, generator=generator).to(dtype)
    outputs = {}
    for fuse in (True, False):
        monkeypatch.setattr(moe_grouped, "FUSED_ADD_NORM", fuse)
        residual_TD = x_TD.clone()
        add_norm = AddNorm(residual_TD, norm_D, 1e-6, norm.add_rms_norm_)
        normed_TD = moe_grouped.grouped_moe(h_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True,
                                     torch.zeros(8, dtype=torch.int64), config=_config(moe_gemm), add_norm=add_norm)
        outputs[fuse] = residual_TD, normed_TD
    out_TD = moe_grouped.grouped_moe(h_TD, layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF, 3, True,
                              torch.zeros(8, dtype=torch.int64), config=_config(moe_gemm))
    assert torch.equal(outputs[True][0], x_TD + out_TD)
    expected_TD = rms_norm(x_TD + out_TD, norm_D, 1e-6)  # fp32 on the CPU: rsqrt against 1 / sqrt
    if dtype == torch.float16:
        assert torch.equal(outputs[True][1], expected_TD)
    else:
        torch.testing.assert_close(outputs[True][1], expected_TD, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False]))


def _coarse(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x rounded to multiples of 1 / steps (a power of two): the gate and up products of such
    rows and weights sum exactly in fp32, in any order, so only the roundings can differ."""
    return (x * steps).round() / steps


def _coarse_layer(hidden: int, width: int, dtype, num_experts: int, top_k: int = 3,
                  exact_down: bool = False) -> MoELayer:
    """Coarse gate and gate_up weights; exact_down: each output of W_down one of the expert's
    activations times a power of two, so that the down products sum exactly too."""
    layer = _moe_layer(hidden, width, dtype=dtype, num_experts=num_experts, top_k=top_k)
    for w in (layer.w_gate_ED, layer.w_gate_up_LGD, layer.w_down_LDF):
        w.copy_(_coarse(w, 256))
    if exact_down:
        generator = torch.Generator().manual_seed(hidden)
        column_LD1 = torch.randint(width, (num_experts, hidden, 1), generator=generator)
        scale_LD1 = 2.0 ** torch.randint(-2, 2, (num_experts, hidden, 1), generator=generator)
        layer.w_down_LDF.zero_().scatter_(2, column_LD1, scale_LD1.to(dtype))
    return layer


def _assert_within_one_unit(y_PD: torch.Tensor, expected_PD: torch.Tensor):
    """fp16 outputs of the same roundings whose last fp32 sums differ in order: the same bits but
    where such a sum crossed a rounding boundary, there one unit."""
    unit_PD = torch.finfo(torch.float16).eps * expected_PD.float().abs().clamp_min(2 ** -14)
    assert ((y_PD.float() - expected_PD.float()).abs() <= unit_PD).all()
    assert (y_PD != expected_PD).sum() <= 0.01 * y_PD.numel()


def _sorted_rows(counts_L: list[int], num_padding: int, hidden: int, dtype, seed: int):
    """Rows as dispatch gives them (expert l's ending at offsets_L[l]) plus num_padding rows of NaN
    after them, which must not reach any expert's output."""
    num_valid = sum(counts_L)
    x_PD = torch.randn(num_valid + num_padding, hidden, generator=torch.Generator().manual_seed(seed))
    x_PD = _coarse(x_PD, 64).to(dtype)
    x_PD[num_valid:] = float("nan")
    offsets_L = torch.tensor(counts_L, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x_PD, offsets_L


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_segments_pad_sorted_rows(moe_align, block_m):
    """Each expert's rows (empty ones too) in a segment padded to block_m, positions naming their row."""
    counts_L = [3, 0, 17, 1, 0, 0, 40, 16]
    _, offsets_L = _sorted_rows(counts_L, 0, 1, torch.float32, seed=0)
    a = moe_align.segments(offsets_L, sum(counts_L) + 5, block_m)  # 5 padding rows: no segment
    counts_L = torch.tensor(counts_L)
    padded_L = (counts_L + block_m - 1) // block_m * block_m
    assert torch.equal(a.counts_E.long(), counts_L)
    assert torch.equal(a.ends_E.long(), padded_L.cumsum(0))
    assert torch.equal(a.starts_E.long(), padded_L.cumsum(0) - padded_L)
    assert a.sorted_ids_P.shape[0] >= int(padded_L.sum()) and a.sorted_ids_P.shape[0] % block_m == 0
    for expert, (start, count) in enumerate(zip(a.starts_E.tolist(), counts_L.tolist())):
        first_row = int(offsets_L[expert]) - count
        assert torch.equal(a.sorted_ids_P[start:start + count].long(), torch.arange(first_row, first_row + count))


@pytest.mark.parametrize("counts_L,num_padding", [([], 0), ([0, 0, 0], 4), ([1], 0), ([2, 0, 3], 0),
                                                  ([5, 0, 9, 1, 0, 22, 2, 0], 6), ([19, 40, 11], 3)])
@pytest.mark.parametrize("shape", [(48, 40), (64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sorted_experts_matches_experts(moe_gemm, counts_L, num_padding, shape, dtype):
    """Expert-parallel rows (sorted by local expert, NaN padding rows after them, empty experts, P 0)
    against moe_experts.experts' torch code. Coarse inputs make gate and up exact sums; the down sums still
    differ in order (numpy's blocks of 16 against the CPU BLAS), and in fp32 so does exp."""
    hidden, width = shape
    num_local = max(len(counts_L), 1)
    layer = _coarse_layer(hidden, width, dtype, num_local)
    x_PD, offsets_L = _sorted_rows(counts_L, num_padding, hidden, dtype, seed=len(counts_L) + num_padding)
    if not counts_L:
        offsets_L = torch.zeros(1, dtype=torch.int32)  # one expert, no rows
    num_valid = int(offsets_L[-1])
    expected_PD = experts(x_PD, offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF)
    y_PD = moe_gemm.sorted_experts(x_PD, offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF, config=_config(moe_gemm))
    assert y_PD.shape == (num_valid + num_padding, hidden) and y_PD.dtype == dtype
    if dtype == torch.float16:
        _assert_within_one_unit(y_PD[:num_valid], expected_PD[:num_valid])
    else:
        torch.testing.assert_close(y_PD[:num_valid], expected_PD[:num_valid], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("counts_L,num_padding", [([5, 0, 9, 1, 0, 22, 2, 0], 6), ([19, 40, 11], 3)])
def test_sorted_experts_rounds_like_torch(moe_gemm, counts_L, num_padding):
    """fp16 with every sum exact (coarse rows and weights, one product per down output): only the
    roundings of gate, up, SiLU, the product and the down output remain, and they are torch's."""
    layer = _coarse_layer(64, 32, torch.float16, len(counts_L), exact_down=True)
    x_PD, offsets_L = _sorted_rows(counts_L, num_padding, 64, torch.float16, seed=7)
    num_valid = sum(counts_L)
    expected_PD = experts(x_PD, offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF)
    y_PD = moe_gemm.sorted_experts(x_PD, offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF, config=_config(moe_gemm))
    assert torch.equal(y_PD[:num_valid], expected_PD[:num_valid])


@pytest.mark.parametrize("num_tokens,fixed,has_padding", [(0, True, True), (1, True, False), (13, True, True),
                                                          (13, False, False), (40, False, False)])
def test_sorted_experts_in_the_layer(moe_gemm, num_tokens, fixed, has_padding):
    """gate -> dispatch -> sorted_experts -> combine against the torch experts (fp16), in both
    dispatch modes: the fixed-capacity buffer's padding pairs (left unset) never reach a token."""
    top_k, dtype = 3, torch.float16
    layer = _coarse_layer(64, 32, dtype, 8, top_k, exact_down=True)
    x_TD = _coarse(torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens)), 64).to(dtype)
    ids_TK, weights_TK, counts_E = gate(x_TD, layer.w_gate_ED, top_k, True)
    capacity = step_capacity(num_tokens, top_k, 8, 256 if fixed else 0)
    x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, layer.comm, capacity)
    assert has_padding == (x_PD.shape[0] > int(meta.offsets_L[-1]))  # pairs past the last expert's
    expected_TD = combine(experts(x_PD, meta.offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF), meta, layer.comm)
    y_PD = moe_gemm.sorted_experts(x_PD, meta.offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF,
                                   config=_config(moe_gemm))
    out_TD = combine(y_PD, meta, layer.comm)
    assert torch.equal(out_TD, expected_TD) and bool(out_TD.isfinite().all())


def test_sorted_experts_default_config(moe_gemm):
    """The GPU's tiles for 20 rows per expert (block_m 64: wide blocks past D and F)."""
    layer = _moe_layer(48, 40, num_experts=4)
    x_PD, offsets_L = _sorted_rows([30, 0, 41, 9], 2, 48, torch.float32, seed=3)
    assert moe_gemm.default_config(16 * x_PD.shape[0] // 4).block_m == 64
    y_PD = moe_gemm.sorted_experts(x_PD, offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF)
    expected_PD = experts(x_PD, offsets_L, layer.w_gate_up_LGD, layer.w_down_LDF)
    torch.testing.assert_close(y_PD[:80], expected_PD[:80], atol=1e-5, rtol=1e-5)
