"""A compact training-time Qwen3-MoE, and its weights under the hub's tensor names.

The same architecture as transformers' Qwen3MoeForCausalLM and moemesh's
serving model (RMSNorm in fp32, per-head q/k norms, default RoPE on the two
halves of each head, GQA, softmax top-k routing renormalised, SwiGLU experts),
written for training: the router also returns what the Switch load-balancing
loss needs, and every expert runs on every token with the unselected ones
weighted zero. With 16 small experts that costs little on a GPU, it has static
shapes, and its gradients equal those of a sparse dispatch.
Legend: B batch, T tokens, D hidden, H heads, G KV heads, K head_dim, E experts,
F expert width, V vocab, N = B * T.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.model.checkpoint import expected_tensors
from services.model.config import ModelConfig
from services.model.layers import RotaryEmbedding, apply_rotary, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x_BTD: Tensor, cos_TK: Tensor, sin_TK: Tensor) -> Tensor:
        b, t, _ = x_BTD.shape
        q_BTHK = self.q_norm(self.q_proj(x_BTD).view(b, t, self.num_heads, self.head_dim))
        k_BTGK = self.k_norm(self.k_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim))
        q_BTHK, k_BTGK = apply_rotary(q_BTHK, cos_TK, sin_TK), apply_rotary(k_BTGK, cos_TK, sin_TK)
        v_BTGK = self.v_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        # KV head g serves query heads g * H/G .. (g + 1) * H/G - 1, as transformers' repeat_kv.
        repeat = self.num_heads // self.num_kv_heads
        k_BHTK = k_BTGK.transpose(1, 2).repeat_interleave(repeat, dim=1)
        v_BHTK = v_BTGK.transpose(1, 2).repeat_interleave(repeat, dim=1)
        q_BHTK = q_BTHK.transpose(1, 2).to(v_BHTK.dtype)
        o_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK.to(v_BHTK.dtype), v_BHTK, is_causal=True)
        return self.o_proj(o_BHTK.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class SparseMoE(nn.Module):
    """Router and experts; forward returns the output, router probabilities and top-k ids."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        e, f, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = nn.Linear(d, e, bias=False)
        self.gate_proj = nn.Parameter(torch.empty(e, f, d))  # w_EFD
        self.up_proj = nn.Parameter(torch.empty(e, f, d))  # w_EFD
        self.down_proj = nn.Parameter(torch.empty(e, d, f))  # w_EDF

    def forward(self, x_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        probs_NE = torch.softmax(self.gate(x_ND).float(), dim=-1)
        weights_NK, ids_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        combine_NE = torch.zeros_like(probs_NE).scatter(1, ids_NK, weights_NK)
        e, f, d = self.gate_proj.shape
        # All experts as three dense GEMMs: sum_e w_ne * down_e(h_ne) = down_all(concat_e(w_ne * h_ne)).
        gate_NEF = F.linear(x_ND, self.gate_proj.reshape(e * f, d)).view(-1, e, f)
        up_NEF = F.linear(x_ND, self.up_proj.reshape(e * f, d)).view(-1, e, f)
        h_NEF = F.silu(gate_NEF) * up_NEF * combine_NE.to(up_NEF.dtype)[:, :, None]
        out_ND = F.linear(h_NEF.reshape(-1, e * f), self.down_proj.permute(1, 0, 2).reshape(d, e * f))
        return out_ND, probs_NE, ids_NK


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c)

    def forward(self, x_BTD: Tensor, cos_TK: Tensor, sin_TK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_TK, sin_TK)
        out_ND, probs_NE, ids_NK = self.mlp(self.post_attention_layernorm(x_BTD).flatten(0, 1))
        return x_BTD + out_ND.view_as(x_BTD), probs_NE, ids_NK


class DemoMoE(nn.Module):
    """forward(ids [B, T]) -> (logits [B, T, V], per-layer router probabilities, per-layer top-k ids)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        if c.mlp_only_layers or c.decoder_sparse_step != 1 or not c.tie_word_embeddings:
            raise ValueError("the demo model has MoE in every layer and tied embeddings")
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, "cpu")

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """N(0, std) matrices, residual outputs scaled down by sqrt(2 * layers), unit norms."""
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                scale = out_std if name.endswith(("o_proj.weight", "down_proj")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * scale)

    def forward(self, ids_BT: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        positions_T = torch.arange(ids_BT.shape[1], device=ids_BT.device)
        self.rotary.inv_freq = self.rotary.inv_freq.to(ids_BT.device)
        cos_TK, sin_TK = self.rotary.cos_sin(positions_T, torch.float32)
        x_BTD = self.embed_tokens(ids_BT)
        all_probs, all_ids = [], []
        for layer in self.layers:
            x_BTD, probs_NE, ids_NK = layer(x_BTD, cos_TK, sin_TK)
            all_probs.append(probs_NE)
            all_ids.append(ids_NK)
        logits_BTV = F.linear(self.norm(x_BTD), self.embed_tokens.weight)
        return logits_BTV, all_probs, all_ids


def load_balancing_loss(probs_NE: Tensor, ids_NK: Tensor) -> Tensor:
    """Switch / Qwen auxiliary loss of one layer: E * sum_e f_e * P_e, where f_e is the share
    of tokens routed to e (summed over the k slots) and P_e its mean router probability.
    Equals k when the routing is uniform."""
    num_experts = probs_NE.shape[-1]
    counts_E = expert_counts(ids_NK, num_experts).float()
    return num_experts * torch.sum(counts_E / ids_NK.shape[0] * probs_NE.mean(dim=0))


def expert_counts(ids_NK: Tensor, num_experts: int) -> Tensor:
    """int64 [E]: how many of the top-k slots chose each expert (scatter_add: no host sync)."""
    ids_R = ids_NK.flatten()
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_R.device)
    return counts_E.scatter_add_(0, ids_R, torch.ones_like(ids_R))


def hub_weights(model: DemoMoE) -> dict[str, Tensor]:
    """The model's tensors under the hub's names, experts split one tensor per projection."""
    c, weights = model.config, {}
    for name, p in model.state_dict().items():
        prefix, _, proj = name.rpartition(".")
        if proj in ("gate_proj", "up_proj", "down_proj"):
            for e in range(c.num_experts):
                weights[f"model.{prefix}.experts.{e}.{proj}.weight"] = p[e]
        else:
            weights[f"model.{name}"] = p
    _check_names(c, weights)
    return {name: t.detach().contiguous() for name, t in weights.items()}


def load_hub_weights(model: DemoMoE, weights: dict[str, Tensor]) -> None:
    """The inverse of hub_weights: copies hub-named tensors into the model."""
    _check_names(model.config, weights)
    state = {}
    for name, p in model.state_dict().items():
        prefix, _, proj = name.rpartition(".")
        if proj in ("gate_proj", "up_proj", "down_proj"):
            state[name] = torch.stack([weights[f"model.{prefix}.experts.{e}.{proj}.weight"]
                                       for e in range(model.config.num_experts)])
        else:
            state[name] = weights[f"model.{name}"]
    model.load_state_dict(state)


def _check_names(c: ModelConfig, weights: dict[str, Tensor]) -> None:
    expected = expected_tensors(c, range(c.num_experts))
    found = {name: tuple(t.shape) for name, t in weights.items()}
    assert found == expected, sorted(set(found.items()) ^ set(expected.items()))[:4]
