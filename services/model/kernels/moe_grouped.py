"""The MoE of one rank holding every expert, for steps too big for moe_small.fused_moe (issue 8).

The dispatch path (moe_dispatch: gate -> dispatch -> experts -> combine) runs for any number of
ranks; with one rank that still packs, copies and re-sorts message buffers. Here every expert is
local, so the layer is five short steps, with no host sync and every grid and buffer sized from
T alone (capturable in a CUDA graph):

1. route (routing.route): each token's K experts in increasing order, weights, hit counts.
   Up to routing.GATE_ROUTE_ROWS_MAX_TOKENS tokens, gate_route_rows does the gate matmul
   and this in one kernel, and counts each ALIGN_TOKENS tokens' rows per expert for step 2.
2. align (moe_align.align): the routed rows sorted by expert into padded segments.
3. gate_up (moe_gemm): SiLU(gate) * up over the segments, gathering x rows by index: act_PF.
4. down (moe_gemm): the grouped GEMM on act_PF, storing each output row at its routed row: y_RD.
5. combine: each token's K outputs times their weights, summed in increasing expert order;
   given an AddNorm (the fused layer loop), also added into the residual stream and normed for
   the next layer in the same kernel.

Each intermediate the torch code stores in the model dtype is rounded the same way here (gate
and up, SiLU, its product, the down output, each weighted output), so outputs match the
dispatch path to within fp32 summation order. `gemms="torch"` runs steps 3-4 as
moe_experts.experts (torch._grouped_mm on gathered rows, unpadded segments) instead: the
alternative the benchmark compares.

Legend as in moe_dispatch.py: T tokens, D hidden, F expert width, G = 2F, E experts, K experts
per token, R = T * K routed rows, P padded positions.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import moe_align, moe_gemm, routing
from services.model.kernels.norm import add_residual, store_rms_norm
from services.model.layers import AddNorm
from services.model.moe_experts import experts

# The switch the Triton MoE backend reads (False: the dispatch path, e.g. to compare).
ENABLED = True
# grouped_moe given an AddNorm (the fused layer loop) adds its output into the residual stream
# and takes the next RMSNorm in its combine kernel (False: combine, then the AddNorm's own
# add_rms_norm_ kernel, e.g. to compare).
FUSED_ADD_NORM = True


@triton.jit
def _weighted_sum(y_ptr, rows_ptr, weights_ptr, t, d, mask, hidden, TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr):
    """fp32 [BLOCK_D]: token t's K rows of y (columns d) times their weights, each product
    rounded to the model dtype as moe_dispatch.combine stores it, summed in increasing expert order."""
    dtype = y_ptr.dtype.element_ty
    total = tl.zeros(d.shape, tl.float32)
    for k in tl.static_range(TOP_K):
        r = t * TOP_K + k
        row = r
        if HAS_ROWS:
            row = tl.load(rows_ptr + r).to(tl.int64)
        y = tl.load(y_ptr + row * hidden + d, mask=mask, other=0.0).to(tl.float32)
        total += (y * tl.load(weights_ptr + r).to(tl.float32)).to(dtype).to(tl.float32)
    return total


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, weights_ptr, out_ptr, hidden, TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < hidden
    total = _weighted_sum(y_ptr, rows_ptr, weights_ptr, t, d, mask, hidden, TOP_K, HAS_ROWS)
    tl.store(out_ptr + t * hidden + d, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_add_norm_kernel(y_ptr, weights_ptr, x_ptr, norm_ptr, h_ptr, hidden, eps, TOP_K: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < hidden
    total = _weighted_sum(y_ptr, y_ptr, weights_ptr, t, d, mask, hidden, TOP_K, False)
    x = tl.load(x_ptr + t * hidden + d, mask=mask, other=0.0)
    x = add_residual(x_ptr, t * hidden + d, mask, x, total.to(x_ptr.dtype.element_ty))
    w = tl.load(norm_ptr + d, mask=mask, other=0.0).to(tl.float32)
    store_rms_norm(h_ptr, t * hidden + d, mask, x, w, hidden, eps)


def combine(y_XD: Tensor, rows_R: Tensor | None, weights_TK: Tensor) -> Tensor:
    """out_TD: token t's K rows of y (row rows_R[r] for routed row r = t * K + k, or r itself
    for None) times their weights, summed in increasing k."""
    num_tokens, top_k = weights_TK.shape
    hidden = y_XD.shape[1]
    out_TD = y_XD.new_empty(num_tokens, hidden)
    if num_tokens:
        block_d = min(triton.next_power_of_2(hidden), 1024)
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
            y_XD, y_XD if rows_R is None else rows_R, weights_TK, out_TD, hidden, TOP_K=top_k,
            HAS_ROWS=rows_R is not None, BLOCK_D=block_d)
    return out_TD


def combine_add_norm(y_RD: Tensor, weights_TK: Tensor, add_norm: AddNorm) -> Tensor:
    """add_norm(combine(y_RD, None, weights_TK)) in one kernel, the same bits: the combined
    output added into add_norm.x_TD in place, that sum's RMSNorm returned."""
    x_TD, (num_tokens, top_k) = add_norm.x_TD, weights_TK.shape
    assert x_TD.is_contiguous() and x_TD.shape == (num_tokens, y_RD.shape[1])
    h_TD = torch.empty_like(x_TD)
    if num_tokens:
        _combine_add_norm_kernel[(num_tokens,)](
            y_RD, weights_TK, x_TD, add_norm.weight_D, h_TD, x_TD.shape[1], add_norm.eps, TOP_K=top_k,
            BLOCK_D=triton.next_power_of_2(x_TD.shape[1]), num_warps=8)
    return h_TD



def route(x_TD: Tensor, w_gate_ED: Tensor, top_k: int, norm_topk_prob: bool,
          hit_counts_E: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """grouped_moe's routing (step 1): ids_TK, weights_TK and, where gate_route_rows counted
    them, each ALIGN_TOKENS tokens' rows per expert for align (else None); adds the routed
    experts to hit_counts_E."""
    if 1 < x_TD.shape[0] <= routing.GATE_ROUTE_ROWS_MAX_TOKENS:
        assert routing.GATE_ROUTE_ROWS == moe_align.ALIGN_TOKENS
        return routing.gate_route_rows(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    logits_TE = torch.nn.functional.linear(x_TD, w_gate_ED)
    ids_TK, weights_TK = routing.route(logits_TE, top_k, norm_topk_prob, hit_counts_E, x_TD.dtype)[:2]
    return ids_TK, weights_TK, None


def grouped_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
                norm_topk_prob: bool, hit_counts_E: Tensor, config: moe_gemm.MoEConfig | None = None,
                gemms: str = "triton", add_norm: AddNorm | None = None) -> Tensor:
    """MoELayer on one rank holding every expert (expert e in slot e), for any T; adds the
    routed experts to hit_counts_E. gemms "torch": the expert GEMMs as moe_experts.experts. With
    add_norm: add_norm(the output) (fused into the combine, FUSED_ADD_NORM)."""
    num_experts, num_tokens = w_gate_ED.shape[0], x_TD.shape[0]
    assert w_gate_up_EGD.shape[0] == w_down_EDF.shape[0] == num_experts, "no spare slots here"
    assert x_TD.is_contiguous() and w_gate_up_EGD.is_contiguous() and w_down_EDF.is_contiguous()
    if gemms not in ("triton", "torch"):
        raise ValueError(f"gemms must be 'triton' or 'torch', not {gemms!r}")
    block_m = 1 if gemms == "torch" else (config or moe_gemm.default_config(num_tokens)).block_m
    ids_TK, weights_TK, counts_CE = route(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    a = moe_align.align(ids_TK, num_experts, block_m, chunk_counts=counts_CE)
    if gemms == "torch":
        y_PD = experts(x_TD[a.sorted_ids_P // top_k], a.ends_E, w_gate_up_EGD, w_down_EDF)
        out_TD = combine(y_PD, a.pos_R, weights_TK)
        return out_TD if add_norm is None else add_norm(out_TD)
    config = config or moe_gemm.default_config(num_tokens)
    act_PF = moe_gemm.gate_up(x_TD, a, w_gate_up_EGD, top_k, config.gate_up, config.tiles_first)
    y_RD = moe_gemm.down(act_PF, a, w_down_EDF, ids_TK.numel(), config.down, config.tiles_first)
    if add_norm is None:
        return combine(y_RD, None, weights_TK)
    if FUSED_ADD_NORM:
        return combine_add_norm(y_RD, weights_TK, add_norm)
    return add_norm(combine(y_RD, None, weights_TK))
