"""Paged attention behind a small interface, so a GPU kernel can replace the reference.

A backend writes the step's new K/V into the pool's slots and attends each
sequence's queries to its whole context: every cached token, plus the new
ones causally. A sequence's chunk may start mid-sequence (chunked prefill, a
prefix-cache hit), and one batch mixes prefill chunks and decode tokens. In
an expanded decode batch (ForwardBatch.is_expanded) consecutive rows may be
tokens of one sequence, each a decode row whose context ends at itself: a
backend stores every row's K/V before any row attends (the reference always
does).

Backends: "torch" (this module's reference: exact, host loops, any device),
"triton" (services/model/kernels/attention.py: paged kernels, CUDA graph
capturable decode; imported only when asked for, since it needs triton) and
"auto" (triton for CUDA tensors, torch otherwise).

Legend: T tokens, H query heads, G KV heads, K head_dim, C context tokens of one
sequence, Q new tokens of one sequence.
"""

import abc

import torch
from torch import Tensor

from services.kv_pool import KVPool
from services.model.backends import registered
from services.model.batch import ForwardBatch


class AttentionBackend(abc.ABC):
    """Paged attention for one layer of one step."""

    @abc.abstractmethod
    def forward(self, layer: int, q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor,
                batch: ForwardBatch, kv: KVPool, scale: float, out: Tensor | None = None) -> Tensor:
        """Stores k/v at batch.slot_mapping_T in layer `layer` of kv, returns o_THK (`out`, a
        contiguous tensor of q_THK's shape and dtype, if given)."""

    def warm_whole_prompts(self, kv: KVPool, num_heads: int, dtype: torch.dtype, max_tokens: int) -> list[int]:
        """Prepares what the backend would otherwise prepare on the first prompts of up to max_tokens
        tokens (queries of num_heads heads in dtype over kv, on the thread that runs the steps); the
        prompt lengths it ran. None here."""
        return []


class TorchReferenceAttention(AttentionBackend):
    """Per-sequence gather of the context from the pool, then masked softmax attention.

    Simple and exact, not fast: it loops over sequences on the host.
    """

    def forward(self, layer, q_THK, k_TGK, v_TGK, batch, kv, scale, out=None):
        k_cache, v_cache = kv.layer(layer)
        num_heads, head_dim = q_THK.shape[1:]
        num_kv_heads = k_cache.shape[2]
        # Slots flatten (block, offset): one index_copy_ writes every new token
        # but the padding rows (slot -1).
        k_slots = k_cache.view(-1, num_kv_heads, head_dim)
        v_slots = v_cache.view(-1, num_kv_heads, head_dim)
        is_written_T = batch.slot_mapping_T >= 0
        slots_T = batch.slot_mapping_T[is_written_T]
        _store(k_slots, slots_T, k_TGK[is_written_T])
        _store(v_slots, slots_T, v_TGK[is_written_T])

        o_THK = output_like(q_THK, out)
        starts = batch.cu_q_lens
        for i, (q_len, context_len) in enumerate(zip(batch.q_lens, batch.context_lens)):
            slots_C = _context_slots(batch.block_tables_BM[i], context_len, kv.block_size)
            rows = slice(starts[i], starts[i] + q_len)
            o_THK[rows] = _attend(q_THK[rows], _load(k_slots, slots_C, q_THK.dtype),
                                  _load(v_slots, slots_C, q_THK.dtype), scale)
        return o_THK


def output_like(q_THK: Tensor, out: Tensor | None) -> Tensor:
    """A backend's output tensor: `out` (checked), or a new one like q_THK."""
    if out is None:
        return torch.empty_like(q_THK)
    if out.shape != q_THK.shape or out.dtype != q_THK.dtype or not out.is_contiguous():
        raise ValueError(f"attention out must be contiguous {tuple(q_THK.shape)} {q_THK.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out


# A one-byte cache (float8) is copied and gathered through a uint8 view: the CPU has no
# index_copy_ for float8 types.
def _store(cache_NGK: Tensor, slots_T: Tensor, x_TGK: Tensor) -> None:
    if cache_NGK.element_size() == 1 and cache_NGK.is_floating_point():
        cache_NGK.view(torch.uint8).index_copy_(0, slots_T, x_TGK.to(cache_NGK.dtype).view(torch.uint8))
    else:
        cache_NGK.index_copy_(0, slots_T, x_TGK.to(cache_NGK.dtype))


def _load(cache_NGK: Tensor, slots_C: Tensor, dtype: torch.dtype) -> Tensor:
    if cache_NGK.element_size() == 1 and cache_NGK.is_floating_point():
        return cache_NGK.view(torch.uint8)[slots_C].view(cache_NGK.dtype).to(dtype)
    return cache_NGK[slots_C].to(dtype)


def _context_slots(block_table_M: Tensor, context_len: int, block_size: int) -> Tensor:
    positions_C = torch.arange(context_len, device=block_table_M.device)
    return block_table_M.long()[positions_C // block_size] * block_size + positions_C % block_size


def _attend(q_QHK: Tensor, k_CGK: Tensor, v_CGK: Tensor, scale: float) -> Tensor:
    """Grouped-query attention of the last Q context tokens onto all C, causally."""
    q_len, num_heads, _ = q_QHK.shape
    context_len, num_kv_heads, _ = k_CGK.shape
    group = num_heads // num_kv_heads
    # Query head h reads KV head h // group.
    k_HCK = k_CGK.repeat_interleave(group, dim=1).transpose(0, 1)
    v_HCK = v_CGK.repeat_interleave(group, dim=1).transpose(0, 1)
    scores_HQC = torch.matmul(q_QHK.transpose(0, 1), k_HCK.transpose(1, 2)) * scale
    # The new tokens are the context's last Q: query j sits at position C - Q + j.
    q_pos = torch.arange(context_len - q_len, context_len, device=q_QHK.device)
    k_pos = torch.arange(context_len, device=q_QHK.device)
    scores_HQC = scores_HQC.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs_HQC = torch.softmax(scores_HQC, dim=-1, dtype=torch.float32).to(q_QHK.dtype)
    return torch.matmul(probs_HQC, v_HCK).transpose(0, 1)


class AutoAttention(AttentionBackend):
    """Triton for CUDA tensors, the torch reference otherwise; each made on first use."""

    def __init__(self):
        self._backends: dict[str, AttentionBackend] = {}

    def forward(self, layer, q_THK, k_TGK, v_TGK, batch, kv, scale, out=None):
        return self._backend(q_THK.device).forward(layer, q_THK, k_TGK, v_TGK, batch, kv, scale, out)

    def warm_whole_prompts(self, kv, num_heads, dtype, max_tokens):
        return self._backend(kv.layer(0)[0].device).warm_whole_prompts(kv, num_heads, dtype, max_tokens)

    def _backend(self, device: torch.device) -> AttentionBackend:
        name = "triton" if device.type == "cuda" else "torch"
        if name not in self._backends:
            self._backends[name] = make_attention_backend(name)
        return self._backends[name]


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchReferenceAttention,
    "auto": AutoAttention,
}
# Backends whose module registers them on import (it needs a package CI lacks).
_LAZY_BACKEND_MODULES = {"triton": "services.model.kernels.attention"}
ATTENTION_BACKEND_NAMES = ("auto", "torch", "triton")


def make_attention_backend(name: str = "torch") -> AttentionBackend:
    """The registered backend called `name`: one of ATTENTION_BACKEND_NAMES."""
    return registered("attention", name, ATTENTION_BACKENDS, _LAZY_BACKEND_MODULES, ATTENTION_BACKEND_NAMES)()
