"""Qwen3-MoE's serving forward: a varlen batch in, the sampled rows' logits out.

Weights come as the hub's on-disk names, holding only this rank's experts;
attention and the dense layers are replicated on every rank, the experts are
split (see moe.py). Legend: T tokens, D hidden, H heads, G KV heads, K head_dim,
S sampled rows, V vocab.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from services.kv_pool import KVPool
from services.model.attention import AttentionBackend, make_attention_backend
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.layers import RotaryEmbedding, apply_rotary, rms_norm, swiglu_mlp
from services.model.moe import ExpertComm, MoELayer, local_expert_ids, step_capacity

# Steps whose largest rank batch has at most this many tokens dispatch with
# fixed-capacity buffers (decode); bigger ones with host splits (prefill).
DEFAULT_MAX_FIXED_CAPACITY_TOKENS = 256


@dataclasses.dataclass(slots=True)
class _DecoderLayer:
    input_norm_D: Tensor
    w_q_HKD: Tensor  # [H * K, D]
    w_k_GKD: Tensor  # [G * K, D]
    w_v_GKD: Tensor  # [G * K, D]
    w_o_DHK: Tensor  # [D, H * K]
    q_norm_K: Tensor
    k_norm_K: Tensor
    post_attention_norm_D: Tensor
    # (x_TD, dispatch capacity) -> y_TD: an MoELayer, or a dense SwiGLU MLP ignoring the capacity
    feed_forward: Callable[[Tensor, int | None], Tensor]


class _Converted(Mapping):
    """The weights, each moved to the serving dtype and device when read."""

    def __init__(self, weights: Mapping[str, Tensor], dtype, device):
        self._weights, self._dtype, self._device = weights, dtype, device

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._weights:
            raise ValueError(f"weight {name!r} is missing")
        return self._weights[name].to(device=self._device, dtype=self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


class Qwen3MoeModel:
    """The model of one rank: forward(batch, kv) -> fp32 logits of the sampled rows.

    `weights` holds this rank's experts only (`expert_ids` must be its slice for
    `comm`); the experts are stacked into new tensors, so the caller may drop
    the dict afterwards. `attention` names a registered attention backend.
    `max_fixed_capacity_tokens` is the `max_fixed_tokens` of moe.step_capacity
    (0: always host splits); it must be the same on every rank of a group.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Tensor], *,
                 expert_ids: Sequence[int], comm: ExpertComm | None = None,
                 dtype=torch.float32, device="cpu", attention: str = "torch",
                 max_fixed_capacity_tokens: int = DEFAULT_MAX_FIXED_CAPACITY_TOKENS):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.comm = comm or ExpertComm.local()
        self.max_fixed_capacity_tokens = max_fixed_capacity_tokens
        expected = local_expert_ids(config.num_experts, self.comm.rank, self.comm.world_size)
        if list(expert_ids) != list(expected):
            raise ValueError(
                f"expert_ids {list(expert_ids)} are not rank {self.comm.rank}'s slice "
                f"{list(expected)} of {config.num_experts} experts over {self.comm.world_size} ranks"
            )
        w = _Converted(weights, dtype, self.device)
        self.embed_VD = w["model.embed_tokens.weight"]
        # Tied checkpoints have no lm_head.weight: the embedding doubles as the head.
        self.lm_head_VD = self.embed_VD if config.tie_word_embeddings else w["lm_head.weight"]
        self.norm_D = w["model.norm.weight"]
        self.hit_counts_LE = torch.zeros(len(config.moe_layers), config.num_experts,
                                         dtype=torch.int64, device=self.device)
        self.layers = [self._build_layer(w, i, expert_ids) for i in range(config.num_hidden_layers)]
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, self.device)
        self.attention: AttentionBackend = make_attention_backend(attention)

    def _build_layer(self, w: Mapping[str, Tensor], i: int, expert_ids: Sequence[int]) -> _DecoderLayer:
        prefix, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if self.config.is_moe_layer(i):
            feed_forward = MoELayer.from_weights(
                w, prefix + "mlp.", expert_ids,
                top_k=self.config.num_experts_per_tok, norm_topk_prob=self.config.norm_topk_prob,
                comm=self.comm, hit_counts_E=self.hit_counts_LE[self.config.moe_layers.index(i)],
            )
        else:
            feed_forward = functools.partial(
                _dense_mlp,
                w_gate_FD=w[prefix + "mlp.gate_proj.weight"],
                w_up_FD=w[prefix + "mlp.up_proj.weight"],
                w_down_DF=w[prefix + "mlp.down_proj.weight"],
            )
        return _DecoderLayer(
            input_norm_D=w[prefix + "input_layernorm.weight"],
            w_q_HKD=w[attn + "q_proj.weight"],
            w_k_GKD=w[attn + "k_proj.weight"],
            w_v_GKD=w[attn + "v_proj.weight"],
            w_o_DHK=w[attn + "o_proj.weight"],
            q_norm_K=w[attn + "q_norm.weight"],
            k_norm_K=w[attn + "k_norm.weight"],
            post_attention_norm_D=w[prefix + "post_attention_layernorm.weight"],
            feed_forward=feed_forward,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, *, max_tokens_per_rank: int | None = None) -> Tensor:
        """Runs one step, writing its K/V into kv; returns [S, V] fp32 logits.

        Runs (and joins the expert collectives) even for an empty batch.
        `max_tokens_per_rank`, the largest token count of any rank in this
        step, picks the dispatch mode; None finds it with one all_reduce.
        """
        if max_tokens_per_rank is None:
            max_tokens_per_rank = self.comm.max_over_ranks(batch.input_ids_T.shape[0], self.device)
        capacity = step_capacity(max_tokens_per_rank, self.config.num_experts_per_tok,
                                 self.config.num_experts // self.comm.world_size, self.max_fixed_capacity_tokens)
        x_TD = self.embed_VD[batch.input_ids_T]
        cos_TK, sin_TK = self.rotary.cos_sin(batch.positions_T, self.dtype)
        for i, layer in enumerate(self.layers):
            h_TD = rms_norm(x_TD, layer.input_norm_D, self.config.rms_norm_eps)
            x_TD = x_TD + self._attention(i, layer, h_TD, cos_TK, sin_TK, batch, kv)
            h_TD = rms_norm(x_TD, layer.post_attention_norm_D, self.config.rms_norm_eps)
            x_TD = x_TD + layer.feed_forward(h_TD, capacity)
        x_SD = rms_norm(x_TD[batch.sample_indices_S], self.norm_D, self.config.rms_norm_eps)
        return F.linear(x_SD, self.lm_head_VD).float()

    def _attention(self, i: int, layer: _DecoderLayer, h_TD: Tensor, cos_TK: Tensor,
                   sin_TK: Tensor, batch: ForwardBatch, kv: KVPool) -> Tensor:
        c, num_tokens = self.config, h_TD.shape[0]
        q_shape = (num_tokens, c.num_attention_heads, c.head_dim)
        kv_shape = (num_tokens, c.num_key_value_heads, c.head_dim)
        # Qwen3 normalises each head of q and k before the rotation.
        q_THK = rms_norm(F.linear(h_TD, layer.w_q_HKD).view(q_shape), layer.q_norm_K, c.rms_norm_eps)
        k_TGK = rms_norm(F.linear(h_TD, layer.w_k_GKD).view(kv_shape), layer.k_norm_K, c.rms_norm_eps)
        v_TGK = F.linear(h_TD, layer.w_v_GKD).view(kv_shape)
        q_THK = apply_rotary(q_THK, cos_TK, sin_TK)
        k_TGK = apply_rotary(k_TGK, cos_TK, sin_TK)
        o_THK = self.attention.forward(i, q_THK, k_TGK, v_TGK, batch, kv, c.head_dim ** -0.5)
        return F.linear(o_THK.reshape(num_tokens, c.num_attention_heads * c.head_dim), layer.w_o_DHK)


def _dense_mlp(x_TD: Tensor, _capacity: int | None, **weights: Tensor) -> Tensor:
    """A dense layer's feed-forward, called like an MoELayer (it has nothing to dispatch)."""
    return swiglu_mlp(x_TD, **weights)
