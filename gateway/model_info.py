"""What the gateway tells clients about the model it serves (the GetModelInfo call).

`ModelInfo` is fixed when the gateway starts, from the checkpoint's
config.json and the gateway's flags; the number of ranks of the serving group
changes with the group and is added by the servicer at each call. `features`
lists only what this server really supports, so that a client can check
before it relies on one (the names are the public API's, gateway.proto).
"""

import dataclasses
import pathlib

from services.model.config import ModelConfig

# Prompt prefixes computed by earlier requests are reused (Usage.cached_tokens).
FEATURE_PREFIX_CACHE = "prefix_cache"
# SamplingParams' constraint is enforced (structured output: JSON Schema, regex, grammar, choice).
FEATURE_CONSTRAINTS = "constraints"
# SamplingParams.n above 1: several samples of one prompt (gateway/samples.py).
FEATURE_N = "n"


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model, as GetModelInfo reports it (gateway.proto's ModelInfo)."""

    # The checkpoint directory's name (as the ranks report it in GetRankInfo).
    model_name: str
    # config.json's architecture, e.g. Qwen3MoeForCausalLM.
    architecture: str
    # Prompt plus generated tokens of one request (the gateway's RequestLimits.max_context).
    context_length: int
    vocab_size: int
    # The checkpoint's weight dtype, e.g. "bfloat16".
    dtype: str
    num_experts: int
    num_experts_per_tok: int
    # The optional features served (FEATURE_* names).
    features: tuple[str, ...] = ()


def model_info(model_dir: str, model: ModelConfig, *, context_length: int,
               enable_prefix_cache: bool) -> ModelInfo:
    """The ModelInfo of the checkpoint in model_dir (whose config is `model`)."""
    hub = model.to_hub_dict()
    return ModelInfo(
        model_name=pathlib.Path(model_dir).resolve().name,
        architecture=hub["architectures"][0],
        context_length=context_length,
        vocab_size=model.vocab_size,
        dtype=hub["torch_dtype"],
        num_experts=model.num_experts,
        num_experts_per_tok=model.num_experts_per_tok,
        # Every gateway compiles constraints (gateway/server.py) and every rank enforces them.
        features=((FEATURE_PREFIX_CACHE,) if enable_prefix_cache else ()) + (FEATURE_CONSTRAINTS, FEATURE_N),
    )
