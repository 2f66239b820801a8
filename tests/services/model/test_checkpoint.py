"""Checkpoints: make_random_checkpoint writes what transformers loads; load_weights reads a rank's part."""

import dataclasses
import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model.checkpoint import CheckpointError, expected_tensors, load_weights, weight_map
from services.model.config import ModelConfig
from services.model.make_model import PRESETS, main, make_random_checkpoint

SMALL = dataclasses.replace(PRESETS["tiny"], vocab_size=512, eos_token_ids=(510, 511))


def _hf_tensor(hf_state: dict[str, torch.Tensor], name: str, moe_width: int) -> torch.Tensor:
    """The in-memory transformers tensor behind one hub name (v5 fuses experts per layer)."""
    if ".mlp.experts." not in name:
        return hf_state[name]
    prefix, rest = name.split(".mlp.experts.")
    expert, proj = rest.split(".")[:2]
    if proj == "down_proj":
        return hf_state[f"{prefix}.mlp.experts.down_proj"][int(expert)]
    gate_up = hf_state[f"{prefix}.mlp.experts.gate_up_proj"][int(expert)]  # [2 * moe_I, H]: gate then up
    return gate_up[:moe_width] if proj == "gate_proj" else gate_up[moe_width:]


@pytest.mark.parametrize(
    "config, dtype, num_shards",
    [
        (SMALL, torch.float32, 1),
        (SMALL, torch.bfloat16, 3),
        (dataclasses.replace(SMALL, tie_word_embeddings=True), torch.float32, 2),
    ],
    ids=["fp32-single", "bf16-3-shards", "tied-2-shards"],
)
def test_transformers_loads_our_checkpoint(tmp_path, config, dtype, num_shards):
    from transformers import Qwen3MoeForCausalLM

    make_random_checkpoint(tmp_path, config, seed=7, dtype=dtype, num_shards=num_shards, with_tokenizer=False)
    model, info = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ours = load_weights(tmp_path, config, range(config.num_experts), dtype=torch.float32)
    hf_state = model.state_dict()
    for name, tensor in ours.items():
        torch.testing.assert_close(_hf_tensor(hf_state, name, config.moe_intermediate_size), tensor, rtol=0, atol=0)
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in weight_map(tmp_path)
        torch.testing.assert_close(hf_state["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    make_random_checkpoint(path, SMALL, seed=3, dtype=torch.bfloat16, num_shards=3, with_tokenizer=False)
    return path


def test_load_weights_reads_only_its_experts(sharded_dir):
    weights = load_weights(sharded_dir, SMALL, [2, 3])
    assert list(weights) == list(expected_tensors(SMALL, [2, 3]))
    experts = {name.split(".mlp.experts.")[1].split(".")[0] for name in weights if ".mlp.experts." in name}
    assert experts == {"2", "3"}
    # Every trunk tensor is there: the names that differ from a full load are other experts only.
    full = expected_tensors(SMALL, range(SMALL.num_experts))
    assert all(".mlp.experts." in name for name in set(full) - set(weights))
    assert len(full) - len(weights) == len(SMALL.moe_layers) * 6 * 3
    on_disk = {}
    for file_name in set(weight_map(sharded_dir).values()):
        on_disk.update(load_file(sharded_dir / file_name))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, on_disk[name]), name


def test_values_do_not_depend_on_sharding_or_dtype(tmp_path, sharded_dir):
    make_random_checkpoint(tmp_path, SMALL, seed=3, dtype=torch.float32, with_tokenizer=False)
    single = load_weights(tmp_path, SMALL, [0, 7], dtype=torch.bfloat16)
    sharded = load_weights(sharded_dir, SMALL, [0, 7])
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)
    norm = single["model.layers.0.input_layernorm.weight"].float()
    assert 0.85 < norm.min() and norm.max() < 1.15


def test_seed_determines_weights(tmp_path):
    for seed, sub in [(1, "a"), (1, "b"), (2, "c")]:
        make_random_checkpoint(tmp_path / sub, SMALL, seed=seed, with_tokenizer=False)
    a, b, c = (load_file(tmp_path / sub / "model.safetensors") for sub in "abc")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def _rewrite(path, edit) -> None:
    """Applies `edit` to the tensors of one safetensors file in place."""
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def single_dir(tmp_path):
    make_random_checkpoint(tmp_path, SMALL, seed=5, with_tokenizer=False)
    return tmp_path


def test_missing_tensor_is_named(single_dir):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite(single_dir / "model.safetensors", lambda t: t.pop(name))
    load_weights(single_dir, SMALL, [4, 5])  # another rank's expert: not read, no error
    with pytest.raises(CheckpointError, match=name):
        load_weights(single_dir, SMALL, [2, 3])


def test_wrong_shape_is_named_with_both_shapes(single_dir):
    name = "model.layers.1.mlp.down_proj.weight"  # the dense layer: [H, I] = [64, 128]
    _rewrite(single_dir / "model.safetensors", lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{name}.*model.safetensors.*\[128, 64\].*\[64, 128\]"):
        load_weights(single_dir, SMALL, [0])


def test_all_zero_norm_is_refused(single_dir):
    name = "model.layers.3.self_attn.k_norm.weight"
    _rewrite(single_dir / "model.safetensors", lambda t: t[name].zero_())
    with pytest.raises(CheckpointError, match=rf"{name}.*model.safetensors.*all zeros"):
        load_weights(single_dir, SMALL, [0])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_inf_value_is_refused(single_dir, value):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"

    def edit(tensors):
        tensors[name].view(-1)[5] = value
    _rewrite(single_dir / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=rf"{name}.*model.safetensors.*has 1 NaN or Inf value\(s\) "
                                              rf"\(first {value} at flat index 5"):
        load_weights(single_dir, SMALL, [3])


@pytest.mark.parametrize("field, value, says", [
    ("num_hidden_layers", 10 ** 9, "1000000000 layers, the checkpoint holds 4"),
    ("num_experts", 10 ** 9, "1000000000 experts, the checkpoint holds 8"),
])
def test_a_config_claiming_more_than_the_checkpoint_holds_is_refused_before_sizing_anything(single_dir, field,
                                                                                          value, says):
    # Sized by the config, the expected tensors' names alone would fill the memory.
    config = dataclasses.replace(SMALL, **{field: value})
    with pytest.raises(CheckpointError, match=rf"config.json of .* says {says}"):
        load_weights(single_dir, config, range(8))


def test_quantised_dtype_is_refused(single_dir):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(single_dir / "model.safetensors", lambda t: t.update({name: t[name].to(torch.int8) + 1}))
    with pytest.raises(CheckpointError, match=rf"{name}.*I8"):
        load_weights(single_dir, SMALL, [0])


def test_missing_shard_file_is_named(tmp_path):
    make_random_checkpoint(tmp_path, SMALL, seed=5, num_shards=3, with_tokenizer=False)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_weights(tmp_path, SMALL, [0])


def test_index_pointing_at_wrong_shard_names_tensor_and_file(tmp_path):
    make_random_checkpoint(tmp_path, SMALL, seed=5, num_shards=3, with_tokenizer=False)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    wrong = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{name}.*{wrong}"):
        load_weights(tmp_path, SMALL, [0])


def test_no_checkpoint_and_bad_expert_ids(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(tmp_path, SMALL, [0])
    with pytest.raises(ValueError, match=r"\[8\]"):
        expected_tensors(SMALL, [7, 8])
    with pytest.raises(ValueError, match=r"\[1, 1\]"):
        expected_tensors(SMALL, [1, 1])


def test_tiny_preset():
    tiny = PRESETS["tiny"]
    assert tiny.vocab_size == 151936 and tiny.num_attention_heads * tiny.head_dim != tiny.hidden_size
    assert tiny.moe_layers == [0, 2, 3] and not tiny.tie_word_embeddings
    assert PRESETS["tiny-tied"] == dataclasses.replace(tiny, tie_word_embeddings=True)


def test_cli_writes_the_preset(tmp_path):
    assert main([str(tmp_path), "--preset", "tiny", "--seed", "4", "--dtype", "bfloat16",
                 "--num-shards", "2", "--no-tokenizer"]) == 0
    config = ModelConfig.from_model_dir(tmp_path)
    assert config == dataclasses.replace(PRESETS["tiny"], dtype=torch.bfloat16)
    assert sorted(set(weight_map(tmp_path).values())) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": None, "eos_token_id": [151645, 151643]}
    # Rewriting as one file removes the old shards, so the directory holds one checkpoint.
    make_random_checkpoint(tmp_path, PRESETS["tiny"], seed=4, with_tokenizer=False)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_with_tokenizer_calls_the_tokenizer_module(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("services.tokenizer")
    fake.write_tokenizer_files = calls.append
    monkeypatch.setitem(sys.modules, "services.tokenizer", fake)
    make_random_checkpoint(tmp_path, SMALL, seed=0)
    assert calls == [tmp_path]


def test_real_tokenizer_fits_the_tiny_vocab(tmp_path):
    pytest.importorskip("services.tokenizer")
    from tokenizers import Tokenizer

    make_random_checkpoint(tmp_path, dataclasses.replace(SMALL, vocab_size=151936), seed=0)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= PRESETS["tiny"].vocab_size
    assert tokenizer.encode("Hello, world!").ids == [9707, 11, 1879, 0]
