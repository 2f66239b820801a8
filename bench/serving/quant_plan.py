"""What a quantized preset reads per decode step and how one GPU's memory splits: bounds and the KV plan.

Bandwidth bound: a decode step of B sequences reads the dense part (attention
and dense-MLP projections in the preset's stored layout, scales included;
the gates and the LM head in bf16; not the embedding table, of which it reads
B rows) and, per MoE layer, the experts B tokens of top-K routing touch,
E * (1 - (1 - K/E)^B) if routing is uniform, each in the stored layout. Over
gpu_speed.HBM_BYTES_PER_S it is the fastest a step can be.

Memory plan (one rank holding every expert): the expert service builds the
model, then sizes its KV pool at --kv-memory-fraction of the free memory
(expert_svc/model_builder.py: torch.cuda.mem_get_info after the weights); what
the pool leaves must hold what runs later: the activations of the largest
step (a --max-batch-tokens prefill: its hidden states, q/k/v, the routed rows
through gate|up and down, the sampled rows' fp32 logits), the decode CUDA
graphs' pools (one per batch bucket, each a decode step's activations) and
the allocator's slack. `memory_plan` says how much KV that gives in tokens and
whether the rest fits; `kv_fraction` is the largest fraction that leaves the
reserve. The activation figures are estimates from the shapes (upper ends:
every temporary of a layer alive at once), not measurements; the GPU run
reports the KV blocks the service actually made beside them.
Legend: T tokens of a step, D hidden, F expert width, K experts per token.
"""

import dataclasses

from bench.serving.gpu_speed import BYTES_PER_ELEMENT, HBM_BYTES_PER_S, kv_bytes_per_token
from services.model.checkpoint import expected_tensors
from services.model.config import ModelConfig
from services.model.quant.formats import QuantConfig, stored_bytes
from services.model.quant.linear import is_projection
from services.model.random_weights import RandomWeights, preset, preset_quant

# nvidia-smi's total of an H200 (143,771 MiB).
H200_BYTES = 143_771 * 2**20
# Taken before the KV pool is sized and not by torch tensors: the CUDA context, cuBLAS and NCCL workspaces.
CUDA_CONTEXT_BYTES = 1_000_000_000
# The caching allocator's rounding and fragmentation: kept free beyond the estimated peak.
ALLOCATOR_SLACK_BYTES = 1_000_000_000
DEFAULT_KV_FRACTION = 0.8  # expert_svc.config.ExpertConfig.kv_memory_fraction
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # expert_svc's default decode-graph batch buckets
LOGIT_BYTES = 4  # the sampled rows' logits are fp32


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_bytes(name: str, shape, quant: QuantConfig | None) -> int:
    if quant is not None and is_projection(name):
        return stored_bytes(quant, *shape)
    return BYTES_PER_ELEMENT * _numel(shape)


def expert_bytes(config: ModelConfig, quant: QuantConfig | None) -> int:
    """One expert's gate, up and down projections in one layer, as stored."""
    f, d = config.moe_intermediate_size, config.hidden_size
    return sum(_tensor_bytes("x_proj.weight", shape, quant) for shape in ((f, d), (f, d), (d, f)))


def step_weight_bytes(config: ModelConfig, quant: QuantConfig | None, batch: int) -> float:
    """Bytes of weights one decode step of `batch` tokens reads (uniform routing), on one rank
    holding every expert."""
    trunk = expected_tensors(config, [])  # everything but the experts
    dense = sum(_tensor_bytes(n, s, quant) for n, s in trunk.items() if n != "model.embed_tokens.weight")
    e, k = config.num_experts, config.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    rows = BYTES_PER_ELEMENT * batch * config.hidden_size
    return dense + rows + len(config.moe_layers) * touched * expert_bytes(config, quant)


def quant_bound(preset_name: str, batch: int, context: int = 0, kv_element_bytes: int = BYTES_PER_ELEMENT) -> dict:
    """The HBM bound of a decode step of `batch` sequences of a (quantized) preset on one GPU;
    with a context, also the bound that adds the KV reads."""
    config = preset(preset_name)
    weights = step_weight_bytes(config, preset_quant(preset_name), batch)
    step_s = weights / HBM_BYTES_PER_S
    kv_s = batch * context * kv_bytes_per_token(config, kv_element_bytes) / HBM_BYTES_PER_S
    return {"weight_gb_per_step": round(weights / 1e9, 3), "step_ms": round(1e3 * step_s, 3),
            "tokens_per_s": round(batch / step_s, 1), "step_ms_with_kv": round(1e3 * (step_s + kv_s), 3),
            "tokens_per_s_with_kv": round(batch / (step_s + kv_s), 1)}


def step_activation_bytes(config: ModelConfig, tokens: int, sampled_rows: int) -> int:
    """An upper estimate of one step's activations in bf16: a layer's temporaries all alive at
    once (the residual stream and its norm, q/k/v and attention's output, the T*K routed rows
    through gate|up, the activation and down), plus the sampled rows' fp32 logits."""
    d, f, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    attention = config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = max(tokens * k * (2 * d + 3 * f), tokens * 3 * config.intermediate_size)
    per_layer = tokens * (4 * d + attention) + mlp
    return BYTES_PER_ELEMENT * per_layer + LOGIT_BYTES * sampled_rows * config.vocab_size


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """How one GPU's memory splits for a preset served by one rank (bytes unless named)."""

    preset: str
    device_bytes: int
    weight_bytes: int
    free_after_weights: int
    kv_fraction: float
    kv_bytes: int
    kv_tokens: int  # whole blocks of block_size tokens
    reserve_bytes: int  # activations + graph pools + slack: what must stay free after the KV pool
    left_after_kv: int

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0 and self.left_after_kv >= self.reserve_bytes

    def summary(self) -> dict:
        gb = {f.name: round(getattr(self, f.name) / 1e9, 2) for f in dataclasses.fields(self)
              if f.name.endswith(("bytes", "weights", "after_kv"))}
        return {"preset": self.preset, "kv_fraction": self.kv_fraction, "kv_tokens": self.kv_tokens,
                "fits": self.fits, **{k.removesuffix("_bytes") + "_gb": v for k, v in gb.items()}}


def reserve_bytes(config: ModelConfig, max_batch_tokens: int, max_decode_batch: int) -> int:
    """What must stay free after the KV pool: the largest step's activations, the graph pools, slack."""
    prefill = step_activation_bytes(config, max_batch_tokens, max_decode_batch)
    graphs = sum(step_activation_bytes(config, b, b) for b in GRAPH_BUCKETS if b <= max_decode_batch)
    return prefill + graphs + ALLOCATOR_SLACK_BYTES


def memory_plan(preset_name: str, *, device_bytes: int = H200_BYTES, kv_fraction: float = DEFAULT_KV_FRACTION,
                kv_element_bytes: int = BYTES_PER_ELEMENT, block_size: int = 16, max_batch_tokens: int = 8192,
                max_decode_batch: int = 256) -> MemoryPlan:
    """The memory plan of `preset_name` on one GPU of device_bytes with the service's KV sizing."""
    config = preset(preset_name)
    weights = RandomWeights(config, range(config.num_experts), 0, quant=preset_quant(preset_name)).num_bytes()
    free = max(0, device_bytes - CUDA_CONTEXT_BYTES - weights)
    kv = int(free * kv_fraction)
    block = block_size * kv_bytes_per_token(config, kv_element_bytes)
    tokens = kv // block * block_size
    return MemoryPlan(preset_name, device_bytes, weights, free, kv_fraction, kv, tokens,
                      reserve_bytes(config, max_batch_tokens, max_decode_batch), free - kv)


def kv_fraction(preset_name: str, **kwargs) -> float:
    """The largest --kv-memory-fraction (at most the default, 2 decimals) whose plan leaves the
    reserve; ValueError if even none leaves it (the weights do not fit)."""
    plan = memory_plan(preset_name, **kwargs)
    if plan.free_after_weights <= plan.reserve_bytes:
        raise ValueError(f"{preset_name}: {plan.weight_bytes / 1e9:.1f} GB of weights leave "
                         f"{plan.free_after_weights / 1e9:.1f} GB, under the {plan.reserve_bytes / 1e9:.1f} GB reserve")
    best = (plan.free_after_weights - plan.reserve_bytes) / plan.free_after_weights
    return min(kwargs.get("kv_fraction", DEFAULT_KV_FRACTION), int(best * 100) / 100)


# Dense tensor-core peaks of an H200 (FLOP/s): bf16, and fp8 for the FP8 path's GEMMs.
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}


def prompt_flops(config: ModelConfig, prompt_tokens: int) -> float:
    """FLOPs of prefilling one prompt: 2 per active weight per token (attention and dense-MLP
    projections, the gate, K experts of each MoE layer), plus causal attention's QK^T and PV."""
    d, hd = config.hidden_size, config.head_dim
    attention = d * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    moe = config.num_experts * d + config.num_experts_per_tok * 3 * d * config.moe_intermediate_size
    dense_mlp = 3 * d * config.intermediate_size
    num_moe = len(config.moe_layers)
    active = config.num_hidden_layers * attention + num_moe * moe + (config.num_hidden_layers - num_moe) * dense_mlp
    # QK^T and PV: 2 * 2 * heads * head_dim per (query, key) pair, prompt^2 / 2 causal pairs.
    pairs = prompt_tokens * (prompt_tokens + 1) / 2
    return 2.0 * active * prompt_tokens + 4.0 * config.num_hidden_layers * config.num_attention_heads * hd * pairs


def mix_bound(preset_name: str, shapes, concurrency: int, kv_element_bytes: int = BYTES_PER_ELEMENT) -> dict:
    """A requests/s bound of a workload mix: each request's prompt at the tensor-core peak
    (fp8's for an FP8 preset) plus its output tokens at the HBM bound of decode steps of
    `concurrency` sequences at the mix's mean context. `shapes`: (prompt tokens, output
    tokens, share) per request class."""
    config, quant = preset(preset_name), preset_quant(preset_name)
    total = sum(share for _, _, share in shapes)
    prompt = sum(p * share for p, _, share in shapes) / total
    output = sum(o * share for _, o, share in shapes) / total
    peak = PEAK_FLOPS["fp8" if quant is not None and quant.method == "fp8" else "bf16"]
    prefill_s = sum(prompt_flops(config, p) * share for p, _, share in shapes) / total / peak
    decode = quant_bound(preset_name, concurrency, round(prompt + output / 2), kv_element_bytes)
    decode_s = output / decode["tokens_per_s_with_kv"]
    return {"requests_per_s": round(1 / (prefill_s + decode_s), 2), "prefill_ms_per_request": round(1e3 * prefill_s, 2),
            "decode_ms_per_request": round(1e3 * decode_s, 2), "mean_prompt_tokens": round(prompt, 1),
            "mean_output_tokens": round(output, 1)}
