"""The Triton MoE backend of quantized experts ("triton-quant" in moe_backend.py's registry; issue 29).

Layers whose experts are quantized (quant/experts.QuantExperts: block FP8 or
AWQ 4-bit in their stored layouts, gate|up side by side as the kernels read
them) take, per step, the kernel family moe_triton.py would take for dense
experts, in the format's kernels (quant_fp8_moe.py, quant_awq_moe.py):

1. One rank holding every expert in its slot (no replicas), one token
   (launch.SINGLE_TOKEN_KERNELS): routing.gate_route, then the format's
   one_token_experts (per-expert GEMVs on the CUDA cores).
2. One rank, no replicas, any other step: the format's grouped_moe (route,
   align, grouped GEMMs, combine with the residual add and next norm fused).
3. Several ranks at a fixed capacity while moe_ep gathers: moe_ep.gathered_moe
   with the format's grouped GEMMs on the gathered rows.
4. Otherwise the dispatch path (moe_dispatch.py), its experts by the format's
   sorted_experts.

FP8 experts on the "fp8" path take the FP8 tensor-core GEMMs for steps of more
than quant_fp8.WEIGHT_ONLY_MAX_ROWS tokens (gathered rows on several ranks) and
the weight-only GEMMs for smaller ones; on the "weight-only" path always the
weight-only ones. The gate is never quantized: routing is moe_triton's, on the
dense gate. AWQ tiles step at most one group along K (tiny test models have
groups below 128). No host reads and shapes alone pick the kernels, so steps
capture in CUDA graphs. With launch.ENABLED off, or for CPU tensors, every step
takes the torch dispatch path on the dequantized weights.

Legend as in moe_dispatch.py: T tokens of this rank, D hidden, P dispatched pairs, L local slots,
J gathered rows, K experts per token.
"""

import dataclasses

import torch
from torch import Tensor

from services.model.kernels import launch, moe_align, moe_ep, moe_gemm, moe_grouped, quant_awq_moe, quant_fp8_moe
from services.model.kernels import routing
from services.model.kernels.quant_fp8 import WEIGHT_ONLY_MAX_ROWS
from services.model.layers import AddNorm
from services.model.moe_backend import MOE_BACKENDS, QUANTIZED_TRITON, MoEBackend, MoELayerState, dispatched_moe
from services.model.moe_dispatch import combine, dispatch, gate
from services.model.quant.experts import QuantExperts


class ExpertGemms:
    """One layer's quantized expert kernels bound to its stored tensors (built per step: the
    tensors are the layer's own, so replicas copied into them are read)."""

    def __init__(self, experts: QuantExperts):
        self.method, self.path, self.num_slots = experts.method, experts.path, experts.num_slots
        gate_up, down = experts.gate_up_tensors, experts.down.tensors
        if self.method == "fp8":
            self.fp8 = (gate_up["weight"], gate_up["weight_scale_inv"], down["weight"], down["weight_scale_inv"])
        else:
            group = experts.down.group_size
            self.awq = (quant_awq_moe.AwqWeights(gate_up["qweight"], gate_up["qzeros"], gate_up["scales"], group),
                        quant_awq_moe.AwqWeights(down["qweight"], down["qzeros"], down["scales"], group))
            tiles = quant_awq_moe.ONE_TOKEN_TILES
            self.one_token_tiles = dataclasses.replace(tiles, gate_up_d=min(tiles.gate_up_d, group),
                                                       down_f=min(tiles.down_f, group))

    def kernel(self, num_rows: int) -> str:
        """The FP8 GEMMs' kernel for a step of num_rows tokens (rows)."""
        return "fp8" if self.path == "fp8" and num_rows > WEIGHT_ONLY_MAX_ROWS else "weight-only"

    def default_config(self, num_tokens: int) -> moe_gemm.MoEConfig:
        """The format's grouped GEMM tiles for a step of num_tokens."""
        if self.method == "fp8":
            return quant_fp8_moe.default_config(num_tokens)
        return quant_awq_moe.default_config(num_tokens, self.awq[0].group)

    def config(self, config: moe_gemm.MoEConfig) -> moe_gemm.MoEConfig:
        """A given config (moe_ep's) fitted to the format."""
        return config if self.method == "fp8" else quant_awq_moe.fit_config(config, self.awq[0].group)

    def grouped(self, layer: MoELayerState, x_TD: Tensor, add_norm: AddNorm | None) -> Tensor:
        """The format's grouped_moe (one rank holding every expert in its slot)."""
        config = self.default_config(x_TD.shape[0])
        args = (layer.top_k, layer.norm_topk_prob, layer.hit_counts_E, config)
        if self.method == "fp8":
            return quant_fp8_moe.grouped_moe(x_TD, layer.w_gate_ED, *self.fp8, *args, kernel=self.kernel(x_TD.shape[0]),
                                             add_norm=add_norm)
        return quant_awq_moe.grouped_moe(x_TD, layer.w_gate_ED, *self.awq, *args, add_norm=add_norm)

    def one_token(self, x_1D: Tensor, ids_1K: Tensor, weights_1K: Tensor) -> Tensor:
        if self.method == "fp8":
            return quant_fp8_moe.one_token_experts(x_1D, ids_1K, weights_1K, *self.fp8)
        return quant_awq_moe.one_token_experts(x_1D, ids_1K, weights_1K, *self.awq, self.one_token_tiles)

    def sorted_rows(self, x_PD: Tensor, offsets_L: Tensor, num_tokens: int) -> Tensor:
        """The dispatch path's experts on its rows sorted by local slot (a step of num_tokens)."""
        config = self.default_config(16 * x_PD.shape[0] // offsets_L.shape[0])
        if self.method == "fp8":
            return quant_fp8_moe.sorted_experts(x_PD, offsets_L, *self.fp8, config, kernel=self.kernel(num_tokens))
        return quant_awq_moe.sorted_experts(x_PD, offsets_L, *self.awq, config)

    def aligned(self, x_JD: Tensor, a: moe_align.Alignment, top_k: int, num_routed: int,
                config: moe_gemm.MoEConfig) -> Tensor:
        """y_RD of gathered rows aligned to the local slots (moe_ep.local_partials' GEMMs)."""
        config = self.config(config)
        if self.method == "fp8":
            w_gate_up, s_gate_up, w_down, s_down = self.fp8
            kernel = self.kernel(x_JD.shape[0])
            act_PF = quant_fp8_moe.gate_up(x_JD, a, w_gate_up, s_gate_up, top_k, config.gate_up, config.tiles_first,
                                           kernel)
            return quant_fp8_moe.down(act_PF, a, w_down, s_down, num_routed, config.down, config.tiles_first, kernel)
        w_gate_up, w_down = self.awq
        act_PF = quant_awq_moe.gate_up(x_JD, a, w_gate_up, top_k, config.gate_up, config.tiles_first)
        return quant_awq_moe.down(act_PF, a, w_down, num_routed, config.down, config.tiles_first)


def one_rank(layer: MoELayerState) -> bool:
    """Whether the layer is one rank holding every expert in its slot (no replicas)."""
    return layer.comm.world_size == 1 and layer.slot_map is None


def quantized_moe(layer, x_TD: Tensor, capacity: int | None, add_norm: AddNorm | None,
                  gathers: bool) -> Tensor:
    """The layer's output with the quantized expert kernels (the module doc's choice; gathers:
    several ranks at a fixed capacity take moe_ep.gathered_moe)."""
    gemms = ExpertGemms(layer.quant_experts)
    num_tokens = x_TD.shape[0]
    if one_rank(layer):
        if num_tokens == 1 and launch.SINGLE_TOKEN_KERNELS:
            x_1D = x_TD.contiguous()
            ids_1K, weights_1K, _ = routing.gate_route(x_1D, layer.w_gate_ED, layer.top_k, layer.norm_topk_prob,
                                                       layer.hit_counts_E)
            out_TD = gemms.one_token(x_1D, ids_1K, weights_1K)
        elif num_tokens:
            return gemms.grouped(layer, x_TD.contiguous(), add_norm)
        else:
            out_TD = torch.empty_like(x_TD)
        return out_TD if add_norm is None else add_norm(out_TD)
    if gathers and capacity is not None:
        rows_per_rank = capacity // min(layer.top_k, gemms.num_slots)
        return moe_ep.gathered_moe(layer, x_TD, rows_per_rank, add_norm, gemms)
    ids_TK, weights_TK, counts_E = gate(x_TD, layer.w_gate_ED, layer.top_k, layer.norm_topk_prob)
    layer.hit_counts_E += counts_E
    x_PD, meta = dispatch(x_TD, ids_TK, weights_TK, counts_E, layer.comm, capacity, layer.slot_map)
    y_PD = gemms.sorted_rows(x_PD.contiguous(), meta.offsets_L, num_tokens * layer.comm.world_size)
    out_TD = combine(y_PD, meta, layer.comm)
    return out_TD if add_norm is None else add_norm(out_TD)


class QuantTritonMoE(MoEBackend):
    """The quantized expert kernels on CUDA, a kernel family picked per step (see the module doc)."""

    def forward(self, layer, x_TD, capacity, add_norm):
        if not (x_TD.is_cuda and launch.ENABLED):
            out_TD = dispatched_moe(layer, x_TD, capacity)  # the dequantized weights, in torch
            return out_TD if add_norm is None else add_norm(out_TD)
        return quantized_moe(layer, x_TD, capacity, add_norm, self.gathers(x_TD.device))

    def routed_ids(self, layer, x_TD):
        """grouped_moe's own routing where the step takes it (as moe_triton's), else the gate's."""
        if x_TD.is_cuda and launch.ENABLED and one_rank(layer) and x_TD.shape[0] > 1:
            return moe_grouped.route(x_TD.contiguous(), layer.w_gate_ED, layer.top_k, layer.norm_topk_prob,
                                     torch.zeros_like(layer.hit_counts_E))[0]
        return super().routed_ids(layer, x_TD)

    def gathers(self, device):
        return device.type == "cuda" and launch.ENABLED and moe_ep.ENABLED


MOE_BACKENDS[QUANTIZED_TRITON] = QuantTritonMoE
