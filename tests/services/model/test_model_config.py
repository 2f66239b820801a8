"""ModelConfig: both config.json spellings parse to the same config; bad values are quoted."""

import dataclasses
import json

import pytest
import torch

from services.model.config import ModelConfig
from services.model.make_model import PRESETS

SMALL = dataclasses.replace(PRESETS["tiny"], vocab_size=512, eos_token_ids=(510, 511), bos_token_id=509)

# config.json of Qwen/Qwen3-30B-A3B on the hub (transformers 4.51 spellings).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_hub_config_parses():
    config = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (128, 8, 128)
    assert config.dtype == torch.bfloat16 and config.eos_token_ids == (151645,) and config.bos_token_id == 151643
    assert config.moe_layers == list(range(48)) and config.norm_topk_prob


@pytest.mark.parametrize("config", [SMALL, PRESETS["tiny-tied"], dataclasses.replace(
    SMALL, decoder_sparse_step=2, mlp_only_layers=(), rope_theta=5e5, dtype=torch.float16, eos_token_ids=(7,))])
def test_hub_dict_round_trips(config):
    hub = json.loads(json.dumps(config.to_hub_dict()))
    assert hub["num_experts"] == config.num_experts and "num_local_experts" not in hub
    assert ModelConfig.from_dict(hub) == config


def test_transformers5_spellings_parse_to_the_same_config(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(**SMALL.to_hub_dict()).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    # The point of the test: transformers 5 wrote its own spellings, not the hub's.
    assert {"num_local_experts", "rope_parameters", "dtype"} <= written.keys()
    assert not {"num_experts", "rope_theta", "torch_dtype"} & written.keys()
    assert ModelConfig.from_model_dir(tmp_path) == SMALL


@pytest.mark.parametrize(
    "change, quoted",
    [
        ({"hidden_size": -64}, "-64"),
        ({"num_experts_per_tok": 129}, "129"),
        ({"num_key_value_heads": 3}, "3"),
        ({"mlp_only_layers": [48]}, "(48,)"),
        ({"torch_dtype": "float8_e4m3fn"}, "'float8_e4m3fn'"),
        ({"model_type": "llama"}, "'llama'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"rms_norm_eps": 0.0}, "0.0"),
        # The wrong JSON type: refused naming the key, not a TypeError from inside the checks.
        ({"hidden_size": "2048"}, "hidden_size must be an integer, got '2048'"),
        ({"hidden_size": None, "head_dim": None}, "hidden_size must be an integer, got None"),
        ({"num_experts": 128.0}, "num_experts must be an integer, got 128.0"),
        ({"decoder_sparse_step": True}, "decoder_sparse_step must be an integer, got True"),
        ({"mlp_only_layers": 3}, "mlp_only_layers must be a list of layer indices, got 3"),
        ({"mlp_only_layers": ["0"]}, "mlp_only_layers must be a list of integers, got ('0',)"),
        ({"rope_theta": None}, "rope_theta must be a finite number, got None"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number, got nan"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false, got 'yes'"),
        ({"eos_token_id": "2"}, "eos_token_ids must be a list of integers, got ('2',)"),
        ({"bos_token_id": 1.5}, "bos_token_id must be an integer or null, got 1.5"),
    ],
)
def test_bad_values_are_quoted(change, quoted):
    with pytest.raises(ValueError) as excinfo:
        ModelConfig.from_dict({**QWEN3_30B_A3B, **change})
    assert quoted in str(excinfo.value)


def test_missing_keys_are_named(tmp_path):
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("num_experts", "vocab_size")}
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="num_local_experts"):
        ModelConfig.from_dict({**raw, "vocab_size": 8})
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)
