"""One MoE layer's local expert slots, quantized: gate, up and down stacks in the stored layouts.

The stacks have one slot per local expert, spares last (expert_map.py), and
keep the checkpoint's layouts (linear.py), so an expert kernel reads them as
they are and a replica is installed by copying one expert's stored tensors
and scales into a spare slot. `dense` gives the torch MoE path its
w_gate_up_QGD / w_down_QDF (moe_experts.experts' weights), dequantized: kept
when cached (the CPU), else computed per call.
Legend: Q slots, F expert width, G = 2F, D hidden.
"""

import torch
from torch import Tensor

from services.model.quant.linear import QuantWeight


class QuantExperts:
    """The gate_proj, up_proj and down_proj stacks [Q, ...] of one MoE layer's slots."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight, *, dtype: torch.dtype,
                 cache_dense: bool):
        assert gate.lead_shape == up.lead_shape == down.lead_shape and len(gate.lead_shape) == 1
        self.gate, self.up, self.down = gate, up, down
        self.dtype, self.cache_dense = dtype, cache_dense
        self._dense: tuple[Tensor, Tensor] | None = None

    @property
    def method(self) -> str:
        return self.gate.method

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
        """Copies one expert's stored tensors and scales into slot `slot`, in place."""
        for stack, one in ((self.gate, gate), (self.up, up), (self.down, down)):
            stack.copy_slot_(slot, one.to(stack.device))
        if self._dense is not None:
            self._dense[0][slot].copy_(torch.cat((gate.dequantize(self.dtype), up.dequantize(self.dtype))))
            self._dense[1][slot].copy_(down.dequantize(self.dtype))
