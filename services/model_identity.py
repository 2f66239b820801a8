"""What makes two processes serve the same model: its config and its tokenizer.

Every expert service registers this identity in its group settings
(expert_svc/config.py, `ExpertConfig.group_settings`), so that the scheduler
groups only ranks that agree (scheduler_svc/compat.py); the gateway computes
its own from its checkpoint and refuses a group whose ranks registered
another (gateway/model_check.py). Equal identities mean the same config
fields (shape, experts, vocabulary, positions, stored dtype) and the same
tokenizer file bytes; the model directory's path does not matter.

Torch-free: the config is read through dataclasses only.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

from services.tokenizer import qwen3_tokenizer_path

# The group-settings keys of the identity.
IDENTITY_KEYS = ("model_config", "model_shape", "tokenizer")


def config_hash(model_config) -> str:
    """A short hash of every field of a ModelConfig."""
    config_json = json.dumps(dataclasses.asdict(model_config), sort_keys=True, default=str)
    return hashlib.sha256(config_json.encode()).hexdigest()[:16]


def model_shape(model_config) -> str:
    """The fields an operator recognizes a model by, for error messages."""
    mc = model_config
    return (f"vocab {mc.vocab_size}, hidden {mc.hidden_size}, {mc.num_hidden_layers} layers, "
            f"{mc.num_experts} experts (top {mc.num_experts_per_tok})")


def tokenizer_file(model_dir: str) -> Path:
    """The tokenizer.json every role loads for model_dir (services/tokenizer.py,
    `Tokenizer.from_model_dir`): the directory's own, else Qwen3's (built once, cached)."""
    own = Path(model_dir) / "tokenizer.json" if model_dir else None
    return own if own is not None and own.is_file() else qwen3_tokenizer_path()


def tokenizer_hash(model_dir: str) -> str:
    """A short hash of the bytes of model_dir's tokenizer file."""
    digest = hashlib.sha256()
    with tokenizer_file(model_dir).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def identity(model_config, model_dir: str) -> dict[str, str]:
    """The model identity of a process serving model_config with model_dir's tokenizer."""
    return {"model_config": config_hash(model_config), "model_shape": model_shape(model_config),
            "tokenizer": tokenizer_hash(model_dir)}


def describe(identity_: dict) -> str:
    """One line for logs: the shape, then the hashes."""
    return (f"{identity_.get('model_shape', '(shape unknown)')}; config {identity_.get('model_config', '(none)')}, "
            f"tokenizer {identity_.get('tokenizer', '(none)')}")
