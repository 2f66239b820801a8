"""Random-weight startup (services/model/random_weights.py): seeded per tensor, only the
rank's experts, and a mesh whose expert services draw their weights (--random-weights)
gives transformers' greedy tokens on a checkpoint holding the same values."""

import json

import grpc
import pytest
import torch
from safetensors.torch import save_file

from expert_svc.config import ExpertConfig
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.model import random_weights
from services.model.checkpoint import expected_tensors
from services.model.config import ModelConfig
from services.model.moe_dispatch import local_expert_ids
from tests.conftest import hf_greedy
from tests.e2e.test_mesh_e2e import generate, greedy

TINY = random_weights.PRESETS["tiny"]
SEED = 7
NUM_NEW_TOKENS = 8


def test_values_depend_on_seed_and_name_only():
    first = random_weights.RandomWeights(TINY, range(8), SEED)
    again = random_weights.RandomWeights(TINY, range(8), SEED)
    other = random_weights.RandomWeights(TINY, range(8), SEED + 1)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    assert not torch.equal(first[name], first["model.layers.2.self_attn.q_proj.weight"])
    # The order of reads does not matter: a tensor has its own seed.
    assert torch.equal(first["model.norm.weight"], again["model.norm.weight"])
    norm = first["model.layers.0.input_layernorm.weight"]
    assert 0.9 <= norm.min() and norm.max() <= 1.1
    assert abs(first[name].std().item() - random_weights.DEFAULT_INIT_STD) < 0.002
    assert first[name].dtype == torch.bfloat16


def test_only_the_ranks_experts_and_the_same_values_on_any_rank():
    rank1 = random_weights.RandomWeights(TINY, local_expert_ids(8, 1, 2), SEED, dtype=torch.float32)
    whole = random_weights.RandomWeights(TINY, range(8), SEED, dtype=torch.float32)
    experts = {int(n.split(".")[5]) for n in rank1 if ".experts." in n}
    assert experts == {4, 5, 6, 7}
    assert set(rank1) == set(expected_tensors(TINY, range(4, 8)))
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert torch.equal(rank1[name], whole[name])
    with pytest.raises(KeyError):
        rank1["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert rank1.num_bytes() == sum(t.numel() * 4 for t in (rank1[n] for n in rank1))


def test_presets_and_config_checks(tmp_path):
    big = random_weights.preset("qwen3-30b-a3b")
    assert (big.num_hidden_layers, big.hidden_size, big.num_experts, big.moe_intermediate_size) == (48, 2048, 128, 768)
    weights = random_weights.RandomWeights(big, range(128), 0)
    assert 60e9 < weights.num_bytes() < 62e9  # the 61 GB of the bf16 checkpoint
    assert random_weights.preset("qwen3-235b-a22b").num_hidden_layers == 94
    with pytest.raises(ValueError, match="'nope'"):
        random_weights.preset("nope")
    with pytest.raises(ValueError, match="'nope'"):
        ExpertConfig(member_id="e", random_weights="nope")
    with pytest.raises(ValueError, match="model must be"):
        ExpertConfig(member_id="e")
    assert ExpertConfig(member_id="e", random_weights="tiny").model == ""
    with pytest.raises(ValueError, match="-1"):
        random_weights.RandomWeights(TINY, range(8), -1)
    random_weights.main(["--write-model-dir", str(tmp_path), "--preset", "qwen3-30b-a3b"])
    assert ModelConfig.from_model_dir(tmp_path) == big
    assert (tmp_path / "tokenizer.json").is_file() and not list(tmp_path.glob("*.safetensors"))
    assert random_weights.serving_model_config(str(tmp_path), "qwen3-30b-a3b") == big
    with pytest.raises(ValueError, match="differs from preset 'tiny'"):
        random_weights.serving_model_config(str(tmp_path), "tiny")


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """A checkpoint holding the values --random-weights tiny --random-weights-seed SEED draws."""
    path = random_weights.write_model_dir(tmp_path_factory.mktemp("random-ckpt"), "tiny")
    weights = random_weights.RandomWeights(TINY, range(TINY.num_experts), SEED, dtype=torch.float32)
    save_file({name: weights[name] for name in weights}, path / "model.safetensors", metadata={"format": "pt"})
    hub = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hub, "torch_dtype": "float32"}))
    return path


def test_mesh_on_random_weights_matches_transformers(tmp_path, reference_dir):
    from transformers import Qwen3MoeForCausalLM

    model_dir = random_weights.write_model_dir(tmp_path / "no-weights", "tiny")
    spec = launcher.MeshSpec(
        model_dir=str(model_dir), num_ranks=2, device="cpu",
        extra_args={"expert_svc": ["--random-weights", "tiny", "--random-weights-seed", str(SEED)]})
    prompts = [[9707, 11, 1879, 0], [1000, 2000, 3000, 4000, 5000, 6000, 7000], [42]]
    with launcher.Mesh(spec) as mesh, grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        got = [generate(stub, gateway_pb2.GenerateRequest(
            request_id=f"r{i}", input_ids=gateway_pb2.TokenIds(ids=ids), sampling=greedy(NUM_NEW_TOKENS)))[0]
            for i, ids in enumerate(prompts)]
    hf = Qwen3MoeForCausalLM.from_pretrained(
        reference_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    assert got == [hf_greedy(hf, ids, NUM_NEW_TOKENS) for ids in prompts]
