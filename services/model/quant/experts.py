"""One MoE layer's local expert slots, quantized: gate|up and down stacks in the stored layouts.

The stacks have one slot per local expert, spares last (expert_map.py), and
keep the checkpoint's layouts (linear.py), so an expert kernel reads them as
they are and a replica is installed by copying one expert's stored tensors
and scales into a spare slot. The gate and up projections are held side by
side in one stack, as the expert kernels read them (kernels/quant_fp8_moe.py,
quant_awq_moe.py): FP8 weight [Q, 2F, D] with the gate's block scales, then the
up's, [Q, 2 * ceil(F/128), ceil(D/128)] (each half blocked on its own); AWQ
qweight [Q, D, 2F/8], qzeros and scales likewise with the gate's columns first.
`gate` and `up` are views of it, so a copy into either lands in what the
kernels read. `dense` gives the torch MoE path its w_gate_up_QGD / w_down_QDF
(moe_experts.experts' weights), dequantized: kept when cached (the CPU), else
computed per call.
Legend: Q slots, F expert width, G = 2F, D hidden.
"""

import dataclasses

import torch
from torch import Tensor

from services.model.quant.linear import LAYOUT_KEYS, QuantWeight

# The dimension along which each stored tensor holds a linear's output features (AWQ stores
# the weight transposed), counted from the end.
_OUT_DIM = {"fp8": -2, "awq": -1}


class QuantExperts:
    """The gate_proj|up_proj and down_proj stacks [Q, ...] of one MoE layer's slots."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight, *, dtype: torch.dtype,
                 cache_dense: bool):
        assert gate.lead_shape == up.lead_shape == down.lead_shape and len(gate.lead_shape) == 1
        dim = _OUT_DIM[gate.method]
        # gate|up side by side; gate and up become views of it (the separate stacks are dropped).
        self.gate_up_tensors = {key: torch.cat((gate.tensors[key], up.tensors[key]), dim=dim)
                                for key in LAYOUT_KEYS[gate.method]}
        halves = {key: t.split((gate.tensors[key].shape[dim], up.tensors[key].shape[dim]), dim=dim)
                  for key, t in self.gate_up_tensors.items()}
        self.gate = dataclasses.replace(gate, tensors={key: h[0] for key, h in halves.items()}, _dense=None)
        self.up = dataclasses.replace(up, tensors={key: h[1] for key, h in halves.items()}, _dense=None)
        self.down = down
        self.dtype, self.cache_dense = dtype, cache_dense
        self._dense: tuple[Tensor, Tensor] | None = None

    @property
    def method(self) -> str:
        return self.gate.method

    @property
    def path(self) -> str:
        """The compute path of these weights (dispatch.QuantPath.path)."""
        return self.gate.path

    @property
    def num_slots(self) -> int:
        return self.gate.lead_shape[0]

    def dense(self) -> tuple[Tensor, Tensor]:
        """(w_gate_up_QGD, w_down_QDF) dequantized to the compute dtype."""
        if self._dense is not None:
            return self._dense
        dense = (torch.cat((self.gate.dequantize(self.dtype), self.up.dequantize(self.dtype)), dim=1),
                 self.down.dequantize(self.dtype))
        if self.cache_dense:
            self._dense = dense
        return dense

    def load_slot(self, slot: int, gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> None:
        """Copies one expert's stored tensors and scales into slot `slot`, in place (into the
        gate|up stack the kernels read: gate and up are its views)."""
        for stack, one in ((self.gate, gate), (self.up, up), (self.down, down)):
            stack.copy_slot_(slot, one.to(stack.device))
        if self._dense is not None:
            self._dense[0][slot].copy_(torch.cat((gate.dequantize(self.dtype), up.dequantize(self.dtype))))
            self._dense[1][slot].copy_(down.dequantize(self.dtype))
