"""Per-layer top-k routing agreement of a quantized model with its dequantized twin (issue 29).

A quantized model is served with its gate dense, but its hidden states drift
from the dense model's, and with them which experts the gates pick. This
runs both models over the same prompts (one prefill each, teacher forced:
the same tokens in both) and compares, for each MoE layer, the expert set
each model's own gate picks for each token. bench/accuracy/hf_parity.py
reports it beside the logit errors.
Legend: T tokens, K experts per token.
"""

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from services.kv_pool import KVPool
from services.model.batch import build_forward_batch, SeqInput

_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class LayerAgreement:
    """How often two models route the same tokens of one MoE layer to the same experts."""

    layer: int
    num_tokens: int
    overlap: float  # mean share of a token's K experts that both models pick ("top-k routing accuracy")
    exact: float  # share of tokens whose K experts are the same set


def recorded_routing(model, prompts: Sequence[Sequence[int]]) -> dict[int, Tensor]:
    """MoE layer -> the experts model's gate picks for every token of the prompts, [T, K]
    sorted per row (each prompt one prefill, rows in prompt order)."""
    routed: dict[int, list[Tensor]] = {i: [] for i in model.config.moe_layers}
    originals = {i: model.layers[i].feed_forward for i in routed}

    def recording(i: int):
        layer = originals[i]

        def feed_forward(x_TD: Tensor, capacity=None, add_norm=None) -> Tensor:
            routed[i].append(layer.routed_ids(x_TD).sort(dim=-1).values.cpu())
            return layer(x_TD, capacity, add_norm)
        return feed_forward

    try:
        for i in routed:
            model.layers[i].feed_forward = recording(i)
        for ids in prompts:
            num_blocks = -(-len(ids) // _BLOCK_SIZE)
            kv = KVPool.for_model(model.config, num_blocks, _BLOCK_SIZE, model.dtype, model.device)
            batch = build_forward_batch([SeqInput(0, list(ids), 0, list(range(num_blocks)), True)],
                                        _BLOCK_SIZE, model.device)
            model.forward(batch, kv)
    finally:
        for i, layer in originals.items():
            model.layers[i].feed_forward = layer
    return {i: torch.cat(rows) for i, rows in routed.items()}


def routing_agreement(model, twin, prompts: Sequence[Sequence[int]]) -> list[LayerAgreement]:
    """Each MoE layer's routing agreement of `model` (e.g. quantized) with `twin` (e.g. its
    dequantized bf16 twin) on the same prompts."""
    if model.config.moe_layers != twin.config.moe_layers:
        raise ValueError("the two models have different MoE layers")
    ours, theirs = recorded_routing(model, prompts), recorded_routing(twin, prompts)
    report = []
    for i in model.config.moe_layers:
        a_TK, b_TK = ours[i], theirs[i]
        shared_T = (a_TK[:, :, None] == b_TK[:, None, :]).any(-1).sum(-1)
        k = a_TK.shape[1]
        report.append(LayerAgreement(i, a_TK.shape[0], float(shared_T.float().mean() / k),
                                     float((shared_T == k).float().mean())))
    return report


def format_agreement(report: Sequence[LayerAgreement]) -> str:
    """A few lines for a log or a result file: each layer's overlap and exact agreement."""
    lines = [f"layer {r.layer:3d}: top-k overlap {r.overlap:.4%}, same set {r.exact:.4%} ({r.num_tokens} tokens)"
             for r in report]
    mean = sum(r.overlap for r in report) / max(len(report), 1)
    return "\n".join([*lines, f"mean top-k overlap {mean:.4%}"])
