"""The model configuration: what the serving code needs from config.json.

Accepts both spellings found in the field: the hub's (`num_experts`,
`rope_theta`, `torch_dtype`) and the ones transformers 5 writes
(`num_local_experts`, `rope_parameters`, `dtype`).
"""

import dataclasses
import json
import math
import pathlib

import torch

# The dtype names config.json uses (`torch_dtype` or `dtype`).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
)


def _rope_theta(raw: dict) -> float:
    """rope_theta from either spelling; refuses scaled rotary (yarn, ...), which serving lacks."""
    rope = raw.get("rope_parameters") or {}
    for scaling in (raw.get("rope_scaling") or {}, rope):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config rope type {rope_type!r} is not supported (only 'default')")
    theta = raw.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
    # A value of the wrong JSON type is passed through for ModelConfig._check_types to refuse.
    return float(theta) if _is_number(theta) else theta


# The JSON type each field must have, checked on construction (ModelConfig._check_types).
_FIELD_KINDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                     "decoder_sparse_step", "max_position_embeddings"), "int"),
    "rms_norm_eps": "number", "rope_theta": "number",
    "norm_topk_prob": "bool", "tie_word_embeddings": "bool",
    "mlp_only_layers": "ints", "eos_token_ids": "ints", "bos_token_id": "int or None",
}
_KIND_NAMES = {"int": "an integer", "number": "a finite number", "bool": "true or false",
               "ints": "a list of integers", "int or None": "an integer or null"}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Qwen3-MoE architecture, validated on construction."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Width of the dense MLP layers (those in mlp_only_layers or off the sparse step).
    intermediate_size: int
    # Width of one expert's MLP.
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    # Renormalise the top-k routing weights to sum to one.
    norm_topk_prob: bool = True
    # Layer i is an MoE layer iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    # The dtype the checkpoint stores; serving may run in another.
    dtype: torch.dtype = torch.bfloat16
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "intermediate_size", "moe_intermediate_size", "decoder_sparse_step",
            "max_position_embeddings", "rms_norm_eps", "rope_theta",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"config num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ValueError(f"config mlp_only_layers {self.mlp_only_layers} outside the layers")

    def _check_types(self) -> None:
        """ValueError naming the field whose value config.json gave the wrong JSON type."""
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), _FIELD_KINDS.get(field.name)
            if kind is None:
                continue
            if kind == "int":
                ok = _is_int(value)
            elif kind == "number":
                ok = _is_number(value) and math.isfinite(value)
            elif kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "ints":
                ok = isinstance(value, tuple) and all(map(_is_int, value))
            else:  # "int or None"
                ok = value is None or _is_int(value)
            if not ok:
                raise ValueError(f"config {field.name} must be {_KIND_NAMES[kind]}, got {value!r}")

    def is_moe_layer(self, layer: int) -> bool:
        """True if the layer's feed-forward is a mixture of experts."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Builds a config from a parsed config.json, either spelling."""
        model_type = raw.get("model_type", "qwen3_moe")
        if model_type != "qwen3_moe":
            raise ValueError(f"config model_type {model_type!r} is not 'qwen3_moe'")
        missing = [key for key in _REQUIRED_KEYS if key not in raw]
        if missing:
            raise ValueError(f"config lacks required key(s) {missing}")
        num_experts = raw.get("num_experts", raw.get("num_local_experts"))
        if num_experts is None:
            raise ValueError("config has neither num_experts nor num_local_experts")
        dtype_name = raw.get("torch_dtype", raw.get("dtype")) or "bfloat16"
        if dtype_name not in DTYPES:
            raise ValueError(f"config dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        mlp_only = raw.get("mlp_only_layers") or ()
        if not isinstance(mlp_only, (list, tuple)):
            raise ValueError(f"config mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            # (0 when hidden_size or the heads are not integers: their own checks name them.)
            head_dim=raw.get("head_dim") or (raw["hidden_size"] // heads
                                             if _is_int(raw["hidden_size"]) and _is_int(heads) and heads > 0 else 0),
            intermediate_size=raw["intermediate_size"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            num_experts=num_experts,
            num_experts_per_tok=raw["num_experts_per_tok"],
            norm_topk_prob=raw.get("norm_topk_prob", False),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(mlp_only),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            dtype=DTYPES[dtype_name],
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path) -> "ModelConfig":
        """Reads `config.json` of a checkpoint directory."""
        path = pathlib.Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in model directory {str(model_dir)!r}")
        return cls.from_dict(json.loads(path.read_text()))

    def to_hub_dict(self) -> dict:
        """The config.json of a hub checkpoint (hub spellings), as make-model writes it."""
        dtype_name = {v: k for k, v in DTYPES.items()}[self.dtype]
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype_name,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (self.eos_token_ids[0] if self.eos_token_ids else None),
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "initializer_range": 0.02,
            "use_cache": True,
        }
