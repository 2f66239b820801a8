"""Reading a hub-layout Qwen3-MoE checkpoint: only what one rank needs, validated.

A checkpoint directory holds either `model.safetensors` or shards listed in
`model.safetensors.index.json` (its `weight_map`: tensor name -> file). Experts
are stored one tensor per projection (`model.layers.N.mlp.experts.E.gate_proj.weight`),
so a rank opens each file lazily and reads only its own experts' tensors.
Shapes in comments: V vocab, H hidden, E experts, I intermediate.
"""

import json
import logging
import pathlib
from collections.abc import Sequence

import safetensors
import torch

from services.model.config import ModelConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype codes we accept on disk; quantised checkpoints are refused.
_DISK_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint on disk does not match the model config or is broken."""


def expected_tensors(config: ModelConfig, expert_ids: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Every tensor (hub name -> shape) a rank holding `expert_ids` needs to serve."""
    _check_expert_ids(config, expert_ids)
    h, d = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_width, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_width, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_width, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_width)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        if config.is_moe_layer(layer):
            shapes[p + "mlp.gate.weight"] = (config.num_experts, h)
            for e in expert_ids:
                shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", h, config.moe_intermediate_size))
        else:
            shapes.update(_mlp_shapes(p + "mlp.", h, config.intermediate_size))
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    """The SwiGLU projections of one MLP (dense or one expert)."""
    return {
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "up_proj.weight": (width, hidden),
        prefix + "down_proj.weight": (hidden, width),
    }


def _check_expert_ids(config: ModelConfig, expert_ids: Sequence[int]) -> None:
    bad = [e for e in expert_ids if not 0 <= e < config.num_experts]
    if bad:
        raise ValueError(f"expert ids {bad} outside [0, {config.num_experts})")
    if len(set(expert_ids)) != len(expert_ids):
        raise ValueError(f"expert ids {list(expert_ids)} contain duplicates")


def weight_map(model_dir: str | pathlib.Path) -> dict[str, str]:
    """Tensor name -> file name of a checkpoint, from the index or the single file.

    Every shard the index names must exist, whether or not this rank reads it.
    """
    root = pathlib.Path(model_dir)
    if (root / SINGLE_FILE).is_file():
        with safetensors.safe_open(root / SINGLE_FILE, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(root)!r}")
    try:
        names_to_files = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{str(index_path)!r} has no readable weight_map: {exc}") from exc
    for file_name in sorted(set(names_to_files.values())):
        if not (root / file_name).is_file():
            raise CheckpointError(f"shard {file_name!r} named in {INDEX_FILE} is missing from {str(root)!r}")
    return names_to_files


def load_weights(
    model_dir: str | pathlib.Path,
    config: ModelConfig,
    expert_ids: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Reads the tensors of `expected_tensors(config, expert_ids)`, keyed by hub name.

    Converts to `dtype` if given (else keeps the on-disk dtype). Raises
    CheckpointError naming the tensor and file for a missing tensor, a wrong
    shape, an unsupported dtype or an all-zero tensor. Extra tensors are ignored.
    """
    root = pathlib.Path(model_dir)
    shapes = expected_tensors(config, expert_ids)
    names_to_files = weight_map(root)
    missing = [name for name in shapes if name not in names_to_files]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(root)!r} lacks {len(missing)} tensor(s), first {missing[0]!r}"
        )
    by_file: dict[str, list[str]] = {}
    for name in shapes:
        by_file.setdefault(names_to_files[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for file_name, names in by_file.items():
        with safetensors.safe_open(root / file_name, framework="pt", device=str(device)) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name!r} is not in {file_name!r} as the index says")
                weights[name] = _read_tensor(f, name, file_name, shapes[name], dtype)
    logger.info("loaded %d tensors from %s (experts %s)", len(weights), root, list(expert_ids))
    return {name: weights[name] for name in shapes}


def _read_tensor(f, name: str, file_name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """One tensor, its header checked before its data is read."""
    header = f.get_slice(name)
    found_shape, disk_dtype = tuple(header.get_shape()), header.get_dtype()
    if found_shape != shape:
        raise CheckpointError(f"tensor {name!r} in {file_name!r} has shape {list(found_shape)}, expected {list(shape)}")
    if disk_dtype not in _DISK_DTYPES:
        raise CheckpointError(
            f"tensor {name!r} in {file_name!r} has dtype {disk_dtype}, expected one of {sorted(_DISK_DTYPES)}"
        )
    tensor = f.get_tensor(name)
    if not tensor.any():
        raise CheckpointError(f"tensor {name!r} in {file_name!r} is all zeros (a broken conversion?)")
    return tensor if dtype is None else tensor.to(dtype)
