"""The small-batch MoE of one rank holding every expert in Triton: fused_moe (issue 8).

For steps of up to MOE_MAX_TOKENS tokens, bound by reading the weights of the
experts the step touches, each once. Each function mimics moe_experts' and
moe_dispatch's bf16 roundings (every intermediate the torch code stores in the
model dtype is rounded the same way here), so outputs match to within fp32
reduction order. All launch grids come from shapes: capturable in a CUDA
graph, no host reads.

- Routing (routing.route, or routing.gate_route for one token): ids in
  increasing order, weights, hit counts, and pos_TE.
- A gate_up kernel with one program per (touched expert in increasing order,
  column block) computing SiLU(gate) * up for every token routed to it (tl.dot,
  all tokens' rows in one tile; the rows not routed there are dropped; one
  token's on the CUDA cores), which also writes the step's expert list for the
  next kernel; a down kernel with one program per (touched expert, output
  column block) writing each routed row's weighted output, the last of them to
  finish a column block (an atomic count) summing each token's K outputs in
  increasing expert order, as moe_dispatch.combine does. No sort, no
  permutation, no capacity padding; the grids are the largest the step could
  need (min(T * K, E) experts), the programs of untouched slots exit.
- One token (ONE_TOKEN_MOE_TILES): gate_route, then two kernels reading the
  token's experts straight from ids_1K (no pos scan, no plan, no atomics), both
  on the CUDA cores: gate_up with one program per (column block, k), and down
  with one program per block of output columns over all K experts, summing the
  K weighted outputs itself in increasing expert order. They launch as
  programmatic dependent launches (launch.py).

Legend as in moe_dispatch.py: T tokens, D hidden, E experts, F expert width,
G = 2F, K experts per token, R = T * K.
"""

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from services.model.kernels import launch, routing
from services.model.kernels.gemv import gemv_rows
from services.model.kernels.launch import uses_pdl, wait_for_previous_kernel

# Steps of at most this many tokens take fused_moe (one rank, CUDA); bigger ones
# moe_grouped.grouped_moe (one rank) or the dispatch path. Both read each touched expert's
# weights once; above this size grouped_moe is the faster (docs/performance.md). Its kernels
# hold every token's row in one tile, so it is not meant for much bigger steps.
MOE_MAX_TOKENS = 16


@triton.jit
def _expert_gate_up_kernel(x_ptr, pos_ptr, w_ptr, act_ptr, experts_ptr, num_used_ptr, done_ptr, num_done,
                           num_tokens, num_experts, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                           TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DONE: tl.constexpr,
                           NUM_STAGES: tl.constexpr, FMA: tl.constexpr):
    f_block, slot = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    # The step's experts in increasing order: this program's is the slot-th.
    e = tl.arange(0, BLOCK_E)
    pos_TE = tl.load(pos_ptr + t[:, None] * num_experts + e[None, :],
                     mask=t_mask[:, None] & (e < num_experts)[None, :], other=0).to(tl.int32)
    used_E = tl.max(pos_TE, 0) > 0
    num_used = tl.sum(used_E.to(tl.int32), 0)
    expert = tl.sum(tl.where(used_E & (tl.cumsum(used_E.to(tl.int32), 0) == slot + 1), e, 0), 0)
    if slot < num_used:
        if f_block == 0:  # the step's plan for the down kernel: its experts, their count, zeroed counters
            tl.store(experts_ptr + slot, expert)
            if slot == 0:
                tl.store(num_used_ptr, num_used)
                done = tl.arange(0, BLOCK_DONE)
                tl.store(done_ptr + done, tl.zeros([BLOCK_DONE], tl.int32), mask=done < num_done)
        pos_T = tl.load(pos_ptr + t * num_experts + expert, mask=t_mask, other=0).to(tl.int32)
        f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
        f_mask = f < WIDTH
        w_expert = w_ptr + expert.to(tl.int64) * 2 * WIDTH * HIDDEN
        if FMA:  # one token (BLOCK_T 1): its row of each product on the CUDA cores
            acc_gate = gemv_rows(x_ptr, w_expert, HIDDEN, f, f_mask, 0, HIDDEN, BLOCK_F, BLOCK_D, NUM_STAGES, False)
            acc_up = gemv_rows(x_ptr, w_expert + WIDTH * HIDDEN, HIDDEN, f, f_mask, 0, HIDDEN, BLOCK_F, BLOCK_D,
                               NUM_STAGES, False)
            acc_gate, acc_up = acc_gate[None, :], acc_up[None, :]
        else:
            w_gate = w_expert + f[:, None] * HIDDEN
            w_up = w_gate + WIDTH * HIDDEN
            acc_gate = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
            acc_up = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
            for d0 in tl.range(0, HIDDEN, BLOCK_D, num_stages=NUM_STAGES):
                d = d0 + tl.arange(0, BLOCK_D)
                d_mask = d < HIDDEN
                # Every token's row: the rows not routed here are computed and dropped.
                x = tl.load(x_ptr + t[:, None] * HIDDEN + d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                            other=0.0)
                m = f_mask[:, None] & d_mask[None, :]
                acc_gate = tl.dot(x, tl.trans(tl.load(w_gate + d[None, :], mask=m, other=0.0)), acc_gate,
                                  input_precision="ieee")
                acc_up = tl.dot(x, tl.trans(tl.load(w_up + d[None, :], mask=m, other=0.0)), acc_up,
                                input_precision="ieee")
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        row_T = t * TOP_K + pos_T - 1
        tl.store(act_ptr + row_T[:, None] * WIDTH + f[None, :], act.to(dtype),
                 mask=(pos_T > 0)[:, None] & f_mask[None, :])


@triton.jit
def _expert_down_kernel(act_ptr, pos_ptr, weights_ptr, w_ptr, experts_ptr, num_used_ptr, done_ptr, y_ptr, out_ptr,
                        num_tokens, num_experts, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr):
    o_block, slot = tl.program_id(0), tl.program_id(1)
    num_used = tl.load(num_used_ptr)
    if slot < num_used:
        expert = tl.load(experts_ptr + slot).to(tl.int64)
        o = o_block * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = o < HIDDEN
        t = tl.arange(0, BLOCK_T)
        t_mask = t < num_tokens
        pos_T = tl.load(pos_ptr + t * num_experts + expert, mask=t_mask, other=0).to(tl.int32)
        routed_T = pos_T > 0
        row_T = t * TOP_K + pos_T - 1
        w_down = w_ptr + expert * HIDDEN * WIDTH + o[:, None] * WIDTH
        acc = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
        for f0 in tl.static_range(0, WIDTH, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            f_mask = f < WIDTH
            act = tl.load(act_ptr + row_T[:, None] * WIDTH + f[None, :], mask=routed_T[:, None] & f_mask[None, :],
                          other=0.0)
            w = tl.load(w_down + f[None, :], mask=o_mask[:, None] & f_mask[None, :], other=0.0)
            acc = tl.dot(act, tl.trans(w), acc, input_precision="ieee")
        dtype = out_ptr.dtype.element_ty
        weight_T = tl.load(weights_ptr + row_T, mask=routed_T, other=0.0).to(tl.float32)
        y = (acc.to(dtype).to(tl.float32) * weight_T[:, None]).to(dtype)
        tl.store(y_ptr + row_T[:, None] * HIDDEN + o[None, :], y, mask=routed_T[:, None] & o_mask[None, :])
        # The last of the step's experts to finish this block of columns sums each token's K
        # weighted outputs, in increasing expert order as moe_dispatch.combine does. The barrier puts
        # every thread's stores before the (acq_rel, device-scope) count.
        tl.debug_barrier()
        if tl.atomic_add(done_ptr + o_block, 1) == num_used - 1:
            total = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
            for k in tl.static_range(TOP_K):
                total += tl.load(y_ptr + (t * TOP_K + k)[:, None] * HIDDEN + o[None, :],
                                 mask=t_mask[:, None] & o_mask[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + t[:, None] * HIDDEN + o[None, :], total.to(dtype),
                     mask=t_mask[:, None] & o_mask[None, :])


@triton.jit
def _one_token_gate_up_kernel(x_ptr, ids_ptr, w_ptr, act_ptr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                              BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                              PDL: tl.constexpr):
    """act[k, f] = SiLU(gate) * up of the token's k-th expert: gate and up rows f of it in one
    [BLOCK_F, 2, BLOCK_D] tile per step, so both are in flight together. PDL (a programmatic
    dependent launch): waits for gate_route, then lets the down kernel start."""
    f_block, k = tl.program_id(0), tl.program_id(1)
    if PDL:  # gate_route's ids; then the down kernel may launch (ids and weights are final)
        wait_for_previous_kernel()
    expert = tl.load(ids_ptr + k).to(tl.int64)
    f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = (f < WIDTH)[:, None, None]
    rows = f[:, None] + tl.arange(0, 2)[None, :] * WIDTH  # [BLOCK_F, 2]: the gate row, the up row
    w_rows = w_ptr + expert * 2 * WIDTH * HIDDEN + rows.to(tl.int64)[:, :, None] * HIDDEN
    acc = tl.zeros([BLOCK_F, 2, BLOCK_D], tl.float32)
    for d0 in tl.range(0, HIDDEN, BLOCK_D, num_stages=NUM_STAGES):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < HIDDEN
        x = tl.load(x_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + d[None, None, :], mask=f_mask & d_mask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, None, :]
    dtype = act_ptr.dtype.element_ty
    gate, up = tl.split(tl.sum(acc, 2).to(dtype).to(tl.float32))
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + k * WIDTH + f, act.to(dtype), mask=f < WIDTH)


@triton.jit
def _one_token_down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, HIDDEN: tl.constexpr,
                           WIDTH: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
                           BLOCK_F: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """out[o] = sum over k of weight_k * (act[k] @ w_down[ids[k], o]) for a block of output
    columns: every expert's rows in one [BLOCK_K, BLOCK_O, BLOCK_F] tile per step, then the
    K outputs rounded, weighted, rounded and summed in fp32 in order k (increasing expert).
    PDL: starts during gate_up (ids are final once it runs) and waits for it before act."""
    o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o < HIDDEN
    k = tl.arange(0, BLOCK_K)
    k_mask = k < TOP_K
    experts = tl.load(ids_ptr + k, mask=k_mask, other=0).to(tl.int64)
    w_rows = w_ptr + (experts[:, None] * HIDDEN + o[None, :]) * WIDTH  # [BLOCK_K, BLOCK_O]
    ko_mask = (k_mask[:, None] & o_mask[None, :])[:, :, None]
    f = tl.arange(0, BLOCK_F)
    w = tl.load(w_rows[:, :, None] + f[None, None, :], mask=ko_mask & (f < WIDTH)[None, None, :], other=0.0)
    if PDL:  # the first step's weights are on their way: now wait for gate_up's act
        wait_for_previous_kernel()
    act = tl.load(act_ptr + k[:, None] * WIDTH + f[None, :], mask=k_mask[:, None] & (f < WIDTH)[None, :], other=0.0)
    acc = w.to(tl.float32) * act.to(tl.float32)[:, None, :]
    for f0 in tl.range(BLOCK_F, WIDTH, BLOCK_F, num_stages=NUM_STAGES):
        f = f0 + tl.arange(0, BLOCK_F)
        f_mask = f < WIDTH
        act = tl.load(act_ptr + k[:, None] * WIDTH + f[None, :], mask=k_mask[:, None] & f_mask[None, :], other=0.0)
        w = tl.load(w_rows[:, :, None] + f[None, None, :], mask=ko_mask & f_mask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * act.to(tl.float32)[:, None, :]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    y = (tl.sum(acc, 2).to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)  # [BLOCK_K, BLOCK_O]
    total = tl.zeros([BLOCK_O], tl.float32)
    for kk in tl.static_range(TOP_K):  # in order, as moe_dispatch.combine sums (picking row kk adds only zeros)
        total += tl.sum(tl.where(k[:, None] == kk, y, 0.0), 0)
    tl.store(out_ptr + o, total.to(dtype), mask=o_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class MoeTiles:
    """Launch shape of the two expert kernels (see fused_moe)."""

    gate_up_f: int  # gate|up columns per program (BLOCK_F)
    gate_up_d: int  # hidden elements per step of its reduction loop (BLOCK_D)
    gate_up_stages: int
    gate_up_warps: int
    down_o: int  # output columns per program (BLOCK_O)
    down_f: int  # width elements per unrolled step of its reduction (BLOCK_F)
    down_warps: int
    gate_up_fma: bool = False  # one token only: its products on the CUDA cores (no tl.dot)
    # One token only: the ids-indexed kernels (_one_token_*: no pos scan, no atomics, down
    # summing its K outputs itself), down_stages their reduction's pipeline depth.
    one_token: bool = False
    down_stages: int = 1


# The first one-token tiles (FMA gate_up, tl.dot down), kept to compare with.
FMA_MOE_TILES = MoeTiles(gate_up_f=4, gate_up_d=1024, gate_up_stages=1, gate_up_warps=4, down_o=32, down_f=128,
                         down_warps=4, gate_up_fma=True)
# One token's tiles: the _one_token_* kernels, the fastest on an H200 (docs/performance.md).
ONE_TOKEN_MOE_TILES = MoeTiles(gate_up_f=2, gate_up_d=2048, gate_up_stages=1, gate_up_warps=4, down_o=4, down_f=64,
                               down_warps=4, one_token=True, down_stages=4)


def moe_tiles(num_tokens: int) -> MoeTiles:
    """The tiles fused_moe launches for a step of num_tokens tokens: the fastest of a sweep on
    an H200 at 1, 4, 16 and 64 tokens (Qwen3-30B-A3B's shape), each used from its token count up."""
    if num_tokens == 1 and launch.SINGLE_TOKEN_KERNELS:
        return ONE_TOKEN_MOE_TILES
    if num_tokens < 16:
        return MoeTiles(gate_up_f=32, gate_up_d=256, gate_up_stages=4, gate_up_warps=4,
                        down_o=32, down_f=128, down_warps=4)
    if num_tokens < 64:
        return MoeTiles(gate_up_f=64, gate_up_d=128, gate_up_stages=3, gate_up_warps=4,
                        down_o=32, down_f=128, down_warps=4)
    return MoeTiles(gate_up_f=32, gate_up_d=128, gate_up_stages=4, gate_up_warps=4,
                    down_o=64, down_f=128, down_warps=4)


def fused_moe(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
              norm_topk_prob: bool, hit_counts_E: Tensor) -> Tensor:
    """MoELayer on one rank holding every expert (expert e in slot e) for steps of up to
    MOE_MAX_TOKENS tokens: gate, experts and combine in a matmul and three kernels (one
    token: gate_route and two); adds the routed experts to hit_counts_E."""
    return fused_moe_tiled(x_TD, w_gate_ED, w_gate_up_EGD, w_down_EDF, top_k, norm_topk_prob, hit_counts_E,
                           moe_tiles(x_TD.shape[0]))


def fused_moe_tiled(x_TD: Tensor, w_gate_ED: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor, top_k: int,
                    norm_topk_prob: bool, hit_counts_E: Tensor, tiles: MoeTiles) -> Tensor:
    """fused_moe with the given tiles (for the benchmark's sweep)."""
    assert x_TD.is_contiguous() and w_gate_up_EGD.is_contiguous() and w_down_EDF.is_contiguous()
    assert x_TD.shape[0] <= 128, "every token's row sits in one tile: fused_moe is for small steps"
    assert x_TD.shape[0] == 1 or not (tiles.gate_up_fma or tiles.one_token), "these tiles take one token"
    num_tokens, hidden = x_TD.shape
    num_experts, width = w_gate_ED.shape[0], w_down_EDF.shape[2]
    if launch.SINGLE_TOKEN_KERNELS and num_tokens == 1:
        ids_TK, weights_TK, pos_TE = routing.gate_route(x_TD, w_gate_ED, top_k, norm_topk_prob, hit_counts_E)
    else:
        logits_TE = torch.nn.functional.linear(x_TD, w_gate_ED)
        ids_TK, weights_TK, pos_TE = routing.route(logits_TE, top_k, norm_topk_prob, hit_counts_E, x_TD.dtype)
    if tiles.one_token:
        return one_token_experts(x_TD, ids_TK, weights_TK, w_gate_up_EGD, w_down_EDF, tiles)
    out_TD = torch.empty_like(x_TD)
    if not num_tokens:
        return out_TD
    num_slots = min(num_tokens * top_k, num_experts)  # the most experts a step can touch
    num_o_blocks = triton.cdiv(hidden, tiles.down_o)
    experts_S = torch.empty(num_slots, dtype=torch.int32, device=x_TD.device)
    num_used_1 = torch.empty(1, dtype=torch.int32, device=x_TD.device)
    done_O = torch.empty(num_o_blocks, dtype=torch.int32, device=x_TD.device)
    act_RF = x_TD.new_empty(num_tokens * top_k, width)
    y_RD = x_TD.new_empty(num_tokens * top_k, hidden)
    shapes = dict(HIDDEN=hidden, WIDTH=width, TOP_K=top_k, BLOCK_T=triton.next_power_of_2(num_tokens))
    _expert_gate_up_kernel[(triton.cdiv(width, tiles.gate_up_f), num_slots)](
        x_TD, pos_TE, w_gate_up_EGD, act_RF, experts_S, num_used_1, done_O, num_o_blocks, num_tokens, num_experts,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_F=tiles.gate_up_f, BLOCK_D=tiles.gate_up_d,
        BLOCK_DONE=triton.next_power_of_2(num_o_blocks), NUM_STAGES=tiles.gate_up_stages, FMA=tiles.gate_up_fma,
        num_warps=tiles.gate_up_warps, **shapes)
    _expert_down_kernel[(num_o_blocks, num_slots)](
        act_RF, pos_TE, weights_TK, w_down_EDF, experts_S, num_used_1, done_O, y_RD, out_TD, num_tokens,
        num_experts, BLOCK_O=tiles.down_o, BLOCK_F=tiles.down_f, num_warps=tiles.down_warps, **shapes)
    return out_TD


def one_token_experts(x_1D: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_gate_up_EGD: Tensor, w_down_EDF: Tensor,
                      tiles: MoeTiles) -> Tensor:
    """One token's MoE output from its routing (ids_1K in increasing expert order, as
    route gives them, weights_1K): the two _one_token_* kernels with tiles."""
    return one_token_down(one_token_gate_up(x_1D, ids_1K, w_gate_up_EGD, tiles), ids_1K, weights_1K, w_down_EDF,
                          tiles)


def one_token_gate_up(x_1D: Tensor, ids_1K: Tensor, w_gate_up_EGD: Tensor, tiles: MoeTiles) -> Tensor:
    """act_KF: SiLU(gate) * up of x_1D through each of its K experts, rounded as moe_experts.experts rounds."""
    hidden, (top_k, width) = x_1D.shape[1], (ids_1K.shape[1], w_gate_up_EGD.shape[1] // 2)
    assert x_1D.shape[0] == 1 and x_1D.is_contiguous() and ids_1K.is_contiguous() and w_gate_up_EGD.is_contiguous()
    act_KF = x_1D.new_empty(top_k, width)
    _one_token_gate_up_kernel[(triton.cdiv(width, tiles.gate_up_f), top_k)](
        x_1D, ids_1K, w_gate_up_EGD, act_KF, HIDDEN=hidden, WIDTH=width, BLOCK_F=tiles.gate_up_f,
        BLOCK_D=tiles.gate_up_d, NUM_STAGES=tiles.gate_up_stages, PDL=uses_pdl(x_1D), num_warps=tiles.gate_up_warps,
        launch_pdl=uses_pdl(x_1D))
    return act_KF


def one_token_down(act_KF: Tensor, ids_1K: Tensor, weights_1K: Tensor, w_down_EDF: Tensor, tiles: MoeTiles) -> Tensor:
    """out_1D: the K experts' down projections of act_KF, weighted and summed as moe_dispatch.combine does."""
    (top_k, width), hidden = act_KF.shape, w_down_EDF.shape[1]
    assert act_KF.is_contiguous() and weights_1K.is_contiguous() and w_down_EDF.is_contiguous()
    out_1D = act_KF.new_empty(1, hidden)
    _one_token_down_kernel[(triton.cdiv(hidden, tiles.down_o),)](
        act_KF, ids_1K, weights_1K, w_down_EDF, out_1D, HIDDEN=hidden, WIDTH=width, TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_O=tiles.down_o, BLOCK_F=tiles.down_f,
        NUM_STAGES=tiles.down_stages, PDL=uses_pdl(ids_1K), num_warps=tiles.down_warps, launch_pdl=uses_pdl(ids_1K))
    return out_1D
