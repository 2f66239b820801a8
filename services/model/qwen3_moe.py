"""Qwen3-MoE's serving forward: a varlen batch in, the sampled rows' logits out.

Weights come as the hub's on-disk names, holding only this rank's experts;
attention and the dense layers are replicated on every rank, the experts are
split (see moe.py). Quantized projections (services/model/quant/) stay in
their stored layouts and go through quant.dispatch.linear: a registered
kernel (CUDA, in the fused layer loop too; q|k|v as one weight where their
layouts allow), or F.linear on the dequantized weight (the CPU reference
path); the gate, embeddings, norms and LM head are dense. Legend: T tokens, D hidden,
H heads, G KV heads, K head_dim, S sampled rows, V vocab.
"""

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from services.kv_pool import KVPool
from services.model.attention import AttentionBackend, make_attention_backend
from services.model.batch import ForwardBatch
from services.model.config import ModelConfig
from services.model.layers import AddNorm, RotaryEmbedding, apply_rotary, rms_norm, swiglu_mlp
from services.model.expert_map import SlotMap
from services.model.exchange.comm import ExpertComm
from services.model.moe import MoELayer
from services.model.moe_backend import gathers_on
from services.model.moe_dispatch import local_expert_ids, step_capacity
from services.model.quant.dispatch import QuantPath, choose_path, linear
from services.model.quant.linear import QuantWeight

logger = logging.getLogger(__name__)

# Steps whose largest rank batch has at most this many tokens dispatch with
# fixed-capacity buffers (decode); bigger ones with host splits (prefill).
DEFAULT_MAX_FIXED_CAPACITY_TOKENS = 256


@dataclasses.dataclass(slots=True)
class _DecoderLayer:
    input_norm_D: Tensor
    # q, k, v: None where w_qkv_XD is a QuantWeight (only the concatenated one is kept)
    w_q_HKD: Tensor | QuantWeight | None  # [H * K, D]
    w_k_GKD: Tensor | QuantWeight | None  # [G * K, D]
    w_v_GKD: Tensor | QuantWeight | None  # [G * K, D]
    # [(H + 2G) * K, D]: q, k, v stacked; dense: the three above are views of it. Quantized on
    # CUDA: their stored layouts side by side where they allow it (QuantWeight.concat_outputs),
    # else None (three projections).
    w_qkv_XD: Tensor | QuantWeight | None
    w_o_DHK: Tensor | QuantWeight  # [D, H * K]
    q_norm_K: Tensor
    k_norm_K: Tensor
    post_attention_norm_D: Tensor
    # (x_TD, dispatch capacity) -> y_TD: an MoELayer, or a dense SwiGLU MLP ignoring the capacity
    feed_forward: Callable[..., Tensor]  # (x_TD, capacity, add_norm=None), as MoELayer


class _Converted(Mapping):
    """The weights, each moved to the serving dtype and device when read; a quantized one
    moved as stored and given the compute path of its format (quant.dispatch.choose_path,
    chosen and logged once per format)."""

    def __init__(self, weights: Mapping[str, Tensor | QuantWeight], dtype, device, quantized_kernel: str):
        self._weights, self._dtype, self._device = weights, dtype, device
        self._quantized_kernel = quantized_kernel
        self.quant_paths: dict[str, QuantPath] = {}

    def __getitem__(self, name: str) -> Tensor | QuantWeight:
        if name not in self._weights:
            raise ValueError(f"weight {name!r} is missing")
        weight = self._weights[name]
        if isinstance(weight, Tensor):
            return weight.to(device=self._device, dtype=self._dtype)
        path = self.quant_paths.get(weight.method)
        if path is None:
            path = self.quant_paths[weight.method] = choose_path(self._quantized_kernel, weight.method, self._device)
            logger.info("%s quantized weights: %s path (%s)", weight.method, path.path, path.reason)
        return dataclasses.replace(weight.to(self._device), kernel=path.kernel, path=path.path,
                                   cache_dense=path.cache_dense)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


class Qwen3MoeModel:
    """The model of one rank: forward(batch, kv) -> fp32 logits of the sampled rows.

    `weights` holds this rank's experts only (`expert_ids` must be its slice for
    `comm`); the experts are stacked into new tensors, so the caller may drop
    the dict afterwards. `attention` names a registered attention backend.
    `max_fixed_capacity_tokens` is the `max_fixed_tokens` of moe_dispatch.step_capacity
    (0: always host splits); it must be the same on every rank of a group.
    `num_spare_expert_slots` spare slots per MoE layer hold expert replicas
    (services/model/expert_map.py; all empty at start); the same on every rank.
    `quantized_kernel` picks the path of quantized weights (quant.dispatch.QUANTIZED_KERNELS).
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Tensor], *,
                 expert_ids: Sequence[int], comm: ExpertComm | None = None,
                 dtype=torch.float32, device="cpu", attention: str = "torch",
                 max_fixed_capacity_tokens: int = DEFAULT_MAX_FIXED_CAPACITY_TOKENS,
                 num_spare_expert_slots: int = 0, quantized_kernel: str = "auto"):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.comm = comm or ExpertComm.local()
        self.max_fixed_capacity_tokens = max_fixed_capacity_tokens
        if num_spare_expert_slots < 0:
            raise ValueError(f"num_spare_expert_slots must be >= 0, got {num_spare_expert_slots}")
        self.num_spare_expert_slots = num_spare_expert_slots
        # Physical expert slots per rank and MoE layer: the primaries, then the spares.
        self.num_local_slots = config.num_experts // self.comm.world_size + num_spare_expert_slots
        expected = local_expert_ids(config.num_experts, self.comm.rank, self.comm.world_size)
        if list(expert_ids) != list(expected):
            raise ValueError(
                f"expert_ids {list(expert_ids)} are not rank {self.comm.rank}'s slice "
                f"{list(expected)} of {config.num_experts} experts over {self.comm.world_size} ranks"
            )
        w = _Converted(weights, dtype, self.device, quantized_kernel)
        self.embed_VD = w["model.embed_tokens.weight"]
        # Tied checkpoints have no lm_head.weight: the embedding doubles as the head.
        self.lm_head_VD = self.embed_VD if config.tie_word_embeddings else w["lm_head.weight"]
        self.norm_D = w["model.norm.weight"]
        self.hit_counts_LE = torch.zeros(len(config.moe_layers), config.num_experts,
                                         dtype=torch.int64, device=self.device)
        self.layers = [self._build_layer(w, i, expert_ids) for i in range(config.num_hidden_layers)]
        # format -> its compute path; empty for an unquantized model.
        self.quant_paths = w.quant_paths
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, self.device)
        self.attention: AttentionBackend = make_attention_backend(attention)

    def _build_layer(self, w: Mapping[str, Tensor], i: int, expert_ids: Sequence[int]) -> _DecoderLayer:
        prefix, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if self.config.is_moe_layer(i):
            spares = self.num_spare_expert_slots
            slot_map = spares and SlotMap(self.config.num_experts, self.comm.world_size, spares,
                                          self.comm.rank, self.device)
            feed_forward = MoELayer.from_weights(
                w, prefix + "mlp.", expert_ids, num_spare_slots=spares, slot_map=slot_map or None,
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
        # One q|k|v matrix (one matmul on CUDA); the views give the CPU path the same bits as before.
        w_q_HKD, w_k_GKD, w_v_GKD = (w[attn + f"{p}_proj.weight"] for p in "qkv")
        w_qkv_XD = None
        if all(isinstance(p, Tensor) for p in (w_q_HKD, w_k_GKD, w_v_GKD)):
            w_qkv_XD = torch.cat((w_q_HKD, w_k_GKD, w_v_GKD))
            w_q_HKD, w_k_GKD, w_v_GKD = w_qkv_XD.split([w_q_HKD.shape[0], w_k_GKD.shape[0], w_v_GKD.shape[0]])
        elif all(isinstance(p, QuantWeight) and p.kernel is not None for p in (w_q_HKD, w_k_GKD, w_v_GKD)):
            # One q|k|v kernel launch where kernels compute them (CUDA); the reference path (the
            # CPU) keeps its three projections.
            w_qkv_XD = QuantWeight.concat_outputs((w_q_HKD, w_k_GKD, w_v_GKD))
            if w_qkv_XD is not None:
                w_q_HKD = w_k_GKD = w_v_GKD = None
        return _DecoderLayer(
            input_norm_D=w[prefix + "input_layernorm.weight"],
            w_q_HKD=w_q_HKD,
            w_k_GKD=w_k_GKD,
            w_v_GKD=w_v_GKD,
            w_qkv_XD=w_qkv_XD,
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
        return self.forward_at_capacity(batch, kv, self.dispatch_capacity(max_tokens_per_rank))

    def dispatch_capacity(self, max_tokens_per_rank: int) -> int | None:
        """The MoE dispatch capacity of a step whose largest rank batch has this many
        tokens (moe_dispatch.step_capacity): None for host splits. The same on every rank.
        Expert-parallel layers on CUDA (moe_backend.gathers_on) take every step at a fixed
        capacity: bigger steps than the decode buckets at exactly their largest rank's
        tokens."""
        capacity = step_capacity(max_tokens_per_rank, self.config.num_experts_per_tok,
                                 self.num_local_slots, self.max_fixed_capacity_tokens)
        if capacity is None and self.comm.world_size > 1 and gathers_on(self.device):
            capacity = max_tokens_per_rank * min(self.config.num_experts_per_tok, self.num_local_slots)
        return capacity

    @torch.inference_mode()
    def forward_at_capacity(self, batch: ForwardBatch, kv: KVPool, capacity: int | None, *,
                            logits_SV: Tensor | None = None, last_row_hits_LE: Tensor | None = None) -> Tensor:
        """forward with the dispatch capacity already chosen: what a CUDA graph captures.

        `logits_SV`, if given, receives the fp32 logits (and is returned).
        `last_row_hits_LE`, if given, gets the experts the batch's last row
        is routed to in each MoE layer added to it (a probe of a padding row,
        whose hits the CUDA-graph runner takes back out of hit_counts_LE).
        """
        x_TD = self.embed_VD[batch.input_ids_T]
        cos_TK, sin_TK = self.rotary.cos_sin(batch.positions_T, self.dtype)
        fused = fused_kernels(self.device)
        if fused is not None:
            x_SD = self._layers_fused(fused, x_TD, cos_TK, sin_TK, batch, kv, capacity, last_row_hits_LE)
            return self.logits(x_SD, logits_SV)
        for i, layer in enumerate(self.layers):
            h_TD = rms_norm(x_TD, layer.input_norm_D, self.config.rms_norm_eps)
            x_TD = x_TD + self._attention(i, layer, h_TD, cos_TK, sin_TK, batch, kv)
            h_TD = rms_norm(x_TD, layer.post_attention_norm_D, self.config.rms_norm_eps)
            if last_row_hits_LE is not None and self.config.is_moe_layer(i) and h_TD.shape[0]:
                _add_last_row_hits(layer.feed_forward, h_TD, last_row_hits_LE[self.config.moe_layers.index(i)])
            x_TD = x_TD + layer.feed_forward(h_TD, capacity)
        return self.logits(self.final_norm(x_TD, batch.sample_indices_S), logits_SV)

    def _layers_fused(self, fused, x_TD: Tensor, cos_TK: Tensor, sin_TK: Tensor, batch: ForwardBatch,
                      kv: KVPool, capacity: int | None, last_row_hits_LE: Tensor | None) -> Tensor:
        """The layer loop with kernels/fused_layer.py's kernels (CUDA): each residual add fused with
        the next RMSNorm, one q|k|v matmul, the projections through fused.linear (a GEMV
        kernel for one token; quantized ones their registered kernels); returns the sampled
        rows, final-normed. The work between two attentions is one piece (begin_layers,
        end_layer), what expert_svc/prefill_graphs.py captures per token bucket."""
        x_TD = x_TD.contiguous()
        q_k_v = self.begin_layers(fused, x_TD, cos_TK, sin_TK)
        for i in range(len(self.layers)):
            o_THK = self.attention.forward(i, *q_k_v, batch, kv, self.config.head_dim ** -0.5)
            q_k_v = self.end_layer(fused, i, o_THK, x_TD, cos_TK, sin_TK, capacity, last_row_hits_LE)
        return self.final_norm(x_TD, batch.sample_indices_S)

    def begin_layers(self, fused, x_TD: Tensor, cos_TK: Tensor, sin_TK: Tensor,
                     out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The fused loop's first piece: layer 0's input norm of x_TD (contiguous, the embedded
        tokens) and its q_THK, k_TGK, v_TGK (into `out` if given)."""
        h_TD = fused.add_rms_norm_(x_TD, None, self.layers[0].input_norm_D, self.config.rms_norm_eps)
        return self._qkv_fused(fused, self.layers[0], h_TD, cos_TK, sin_TK, out)

    def end_layer(self, fused, i: int, o_THK: Tensor, x_TD: Tensor, cos_TK: Tensor, sin_TK: Tensor,
                  capacity: int | None, last_row_hits_LE: Tensor | None = None,
                  out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor] | None:
        """The fused loop's piece after layer i's attention (o_THK): its output projection and
        feed-forward, each added into the residual stream x_TD in place, then layer i + 1's input
        norm and q, k, v (into `out` if given); after the last layer None, x_TD holding the
        final residual stream. last_row_hits_LE: see forward_at_capacity."""
        c, eps, layer = self.config, self.config.rms_norm_eps, self.layers[i]
        attn_TD = fused.linear(o_THK.reshape(x_TD.shape[0], c.num_attention_heads * c.head_dim), layer.w_o_DHK)
        h_TD = fused.add_rms_norm_(x_TD, attn_TD, layer.post_attention_norm_D, eps)
        if last_row_hits_LE is not None and c.is_moe_layer(i) and h_TD.shape[0]:
            _add_last_row_hits(layer.feed_forward, h_TD, last_row_hits_LE[c.moe_layers.index(i)])
        if i + 1 == len(self.layers):
            x_TD.add_(layer.feed_forward(h_TD, capacity))
            return None
        # The feed-forward adds its output and takes the next norm (fused into its last kernel).
        following = self.layers[i + 1]
        h_TD = layer.feed_forward(h_TD, capacity, AddNorm(x_TD, following.input_norm_D, eps, fused.add_rms_norm_))
        return self._qkv_fused(fused, following, h_TD, cos_TK, sin_TK, out)

    def logits(self, x_SD: Tensor, logits_SV: Tensor | None = None) -> Tensor:
        """fp32 logits of final-normed rows (final_norm's), into logits_SV if given."""
        return _logits(x_SD, self.lm_head_VD, logits_SV)

    def warm_logits(self, max_rows: int) -> None:
        """Runs the LM head once at each row count 1..max_rows (on zeros): the library picks a
        kernel per count, and CUDA loads a kernel lazily, on its first launch, waiting for the
        device to finish its work; warmed at load time, no step waits for that."""
        x_RD = torch.zeros(max_rows, self.config.hidden_size, dtype=self.lm_head_VD.dtype,
                           device=self.lm_head_VD.device)
        for rows in range(1, max_rows + 1):
            self.logits(x_RD[:rows])

    def final_norm(self, x_TD: Tensor, sample_indices_S: Tensor) -> Tensor:
        """The sampled rows of the final residual stream, final-normed: the LM head's input."""
        return rms_norm(x_TD[sample_indices_S], self.norm_D, self.config.rms_norm_eps)

    def _qkv_fused(self, fused, layer: _DecoderLayer, h_TD: Tensor, cos_TK: Tensor, sin_TK: Tensor,
                   out: tuple[Tensor, Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        return fused.qkv_norm_rotary(_qkv(fused.linear, h_TD, layer), layer.q_norm_K, layer.k_norm_K, cos_TK, sin_TK,
                                     c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, out=out)

    def _attention(self, i: int, layer: _DecoderLayer, h_TD: Tensor, cos_TK: Tensor,
                   sin_TK: Tensor, batch: ForwardBatch, kv: KVPool) -> Tensor:
        c, num_tokens = self.config, h_TD.shape[0]
        q_shape = (num_tokens, c.num_attention_heads, c.head_dim)
        kv_shape = (num_tokens, c.num_key_value_heads, c.head_dim)
        # Qwen3 normalises each head of q and k before the rotation.
        if layer.w_q_HKD is None:  # quantized q|k|v in one weight
            q_TX, k_TX, v_TX = linear(h_TD, layer.w_qkv_XD).split([q_shape[1] * c.head_dim,
                                                                    kv_shape[1] * c.head_dim,
                                                                    kv_shape[1] * c.head_dim], dim=1)
        else:
            q_TX, k_TX, v_TX = (linear(h_TD, w) for w in (layer.w_q_HKD, layer.w_k_GKD, layer.w_v_GKD))
        q_THK = rms_norm(q_TX.reshape(q_shape), layer.q_norm_K, c.rms_norm_eps)
        k_TGK = rms_norm(k_TX.reshape(kv_shape), layer.k_norm_K, c.rms_norm_eps)
        v_TGK = v_TX.reshape(kv_shape)
        q_THK = apply_rotary(q_THK, cos_TK, sin_TK)
        k_TGK = apply_rotary(k_TGK, cos_TK, sin_TK)
        o_THK = self.attention.forward(i, q_THK, k_TGK, v_TGK, batch, kv, c.head_dim ** -0.5)
        return linear(o_THK.reshape(num_tokens, c.num_attention_heads * c.head_dim), layer.w_o_DHK)


# The fused layer loop's kernels, loaded on CUDA only: they need triton, which CPU installs lack.
_FUSED_LAYER_MODULE = "services.model.kernels.fused_layer"


def fused_kernels(device: torch.device):
    """kernels/fused_layer.py's FusedLayerKernels on CUDA while they are enabled, else None
    (the torch code)."""
    if device.type != "cuda":
        return None
    return importlib.import_module(_FUSED_LAYER_MODULE).fused_layer_kernels()


def _qkv(linear: Callable[[Tensor, Tensor | QuantWeight], Tensor], h_TD: Tensor, layer: _DecoderLayer) -> Tensor:
    """The q|k|v projection [T, X]: one matmul, or three side by side where quantized q, k, v
    could not be stored as one weight (QuantWeight.concat_outputs)."""
    if layer.w_qkv_XD is not None:
        return linear(h_TD, layer.w_qkv_XD)
    return torch.cat([linear(h_TD, w) for w in (layer.w_q_HKD, layer.w_k_GKD, layer.w_v_GKD)], dim=1)


def _logits(x_SD: Tensor, lm_head_VD: Tensor, logits_SV: Tensor | None) -> Tensor:
    """fp32 logits of the final-normed rows, into logits_SV if given."""
    if logits_SV is None:
        return F.linear(x_SD, lm_head_VD).float()
    return logits_SV.copy_(F.linear(x_SD, lm_head_VD))


def _add_last_row_hits(layer: MoELayer, h_TD: Tensor, hits_E: Tensor) -> None:
    """Adds the experts of h_TD's last row to hits_E, as the layer's step routes them
    (MoELayer.routed_ids: the same kernels over the same rows)."""
    ids_K = layer.routed_ids(h_TD)[-1]
    hits_E.scatter_add_(0, ids_K, torch.ones_like(ids_K))


def _dense_mlp(x_TD: Tensor, _capacity: int | None, add_norm: AddNorm | None = None, **weights: Tensor) -> Tensor:
    """A dense layer's feed-forward, called like an MoELayer (it has nothing to dispatch)."""
    out_TD = swiglu_mlp(x_TD, **weights)
    return out_TD if add_norm is None else add_norm(out_TD)
