"""Expert parallelism through the whole mesh: groups of N = 1, 2 and 4 expert services give
token-identical greedy outputs, equal to transformers' (fp32), under balanced and unbalanced
load, and a bad N is refused before anything starts.

One mesh per N, started once. The N = 2 and 4 meshes dispatch steps of more than 16 tokens
per rank with host splits and the rest (decode) with fixed-capacity buffers; the shared
N = 1 mesh uses the default threshold (256), so the long prompt is the only host-split step
there: equal outputs across N also mean equal outputs across dispatch modes.
"""

import concurrent.futures
import shutil
import subprocess
import sys

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.model.config import ModelConfig
from tests.conftest import hf_greedy
from tests.e2e.test_mesh_e2e import generate, greedy

NUM_NEW_TOKENS = 12
# Different lengths, many short and one long (more than 256 tokens).
PROMPTS = [
    "Hi",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Expert parallelism splits the experts of every layer over the ranks of a group.",
    "def add(a, b):\n    return a + b\n",
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.",
    "Tokens are routed to experts; " * 4,
    "Q: Why do the ranks run in lockstep?\nA:",
    "Mixture-of-experts models route each token to a few experts of every layer. " * 20,
]
# Fixed-capacity dispatch for steps of up to 16 tokens per rank, host splits above.
EXPERT_ARGS = ["--max-fixed-capacity-tokens", "16"]
# N = 8 is the rank count of the Qwen3-235B-A22B deployment (issue 12), one expert per rank here.
NUM_RANKS = [1, 2, 4, 8]


def _start(model_dir, num_ranks: int) -> launcher.Mesh:
    spec = launcher.MeshSpec(model_dir=str(model_dir), num_ranks=num_ranks, device="cpu",
                             extra_args={"expert_svc": EXPERT_ARGS})
    return launcher.Mesh(spec).start()


@pytest.fixture(scope="module", params=NUM_RANKS, ids=lambda n: f"N{n}")
def stub(request, tiny_model_dir):
    """A stub of the gateway of a mesh of N ranks on the tiny model (N = 1: the shared mesh)."""
    if request.param == 1:
        mesh, own = request.getfixturevalue("mesh"), False
    else:
        mesh, own = _start(tiny_model_dir, request.param), True
    try:
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            yield gateway_pb2_grpc.GenerationServiceStub(channel)
    finally:
        if own:
            mesh.stop()


def _prompt_ids(stub, prompts: list[str]) -> list[list[int]]:
    return [list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=p), timeout=10).token_ids) for p in prompts]


@pytest.fixture(scope="module")
def prompt_ids(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        ids = _prompt_ids(gateway_pb2_grpc.GenerationServiceStub(channel), PROMPTS)
    assert len({len(i) for i in ids}) == len(PROMPTS), "the prompts should have different lengths"
    assert max(len(i) for i in ids) > 256 > sorted(len(i) for i in ids)[-2]
    return ids


@pytest.fixture(scope="module")
def expected(prompt_ids, hf_model):
    """transformers' greedy tokens for each prompt, computed once for every N."""
    return [hf_greedy(hf_model, ids, NUM_NEW_TOKENS) for ids in prompt_ids]


def _generate_all(stub, prompt_ids: list[list[int]], max_workers: int) -> list[list[int]]:
    """Sends every prompt (as ids), max_workers at a time; returns each one's tokens."""
    def one(i: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(request_id=f"r{i}", input_ids=gateway_pb2.TokenIds(ids=prompt_ids[i]),
                                              sampling=greedy(n=NUM_NEW_TOKENS))
        return generate(stub, request)[0]

    with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
        return list(pool.map(one, range(len(prompt_ids))))


def test_concurrent_requests_give_the_reference_tokens_at_every_n(stub, prompt_ids, expected):
    """Nine requests at once: each rank attends to its own sequences, prefill and decode mix."""
    assert _generate_all(stub, prompt_ids, max_workers=len(prompt_ids)) == expected


def test_one_busy_rank_and_idle_ones_give_the_reference_tokens(stub, prompt_ids, expected):
    """One request at a time: a single rank has work, the others run idle steps."""
    picks = [0, len(PROMPTS) - 1, 3]
    assert _generate_all(stub, [prompt_ids[i] for i in picks], max_workers=1) == [expected[i] for i in picks]


# ---- every token routed to the experts of one rank --------------------------------------------


def _write_one_rank_routing_variant(src, dst, top_k: int) -> None:
    """A copy of the checkpoint whose gates send every token to experts 0..top_k-1.

    Qwen3-MoE has no biases, so the bias is a constant hidden feature: dimension 0 of
    every embedding is set to 0.5, every projection that reads the residual stream
    ignores it and every one that writes it leaves it alone (the rest of the model is
    unchanged), and the gates read it with weight +50 for experts 0..top_k-1 and -50
    for the others.
    """
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = 0.5
    for name, w in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                          "up_proj.weight")) or name == "lm_head.weight":
            w[:, 0] = 0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w[0, :] = 0
        elif name.endswith("mlp.gate.weight"):
            w[:, 0] = -50.0
            w[:top_k, 0] = 50.0
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def one_rank_model_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("one-rank-routing") / "model"
    _write_one_rank_routing_variant(tiny_model_dir, path, ModelConfig.from_model_dir(tiny_model_dir).num_experts_per_tok)
    return path


def test_tokens_all_routed_to_one_rank_give_the_reference_tokens(one_rank_model_dir, prompt_ids):
    """N = 2: rank 0 holds experts 0..3 and receives every routed token, rank 1 none."""
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(one_rank_model_dir, dtype=torch.float32,
                                             attn_implementation="eager", experts_implementation="eager").eval()
    top_k = hf.config.num_experts_per_tok
    ids = prompt_ids[:6] + prompt_ids[-1:]
    expected = [hf_greedy(hf, p, NUM_NEW_TOKENS) for p in ids]
    for p, new in zip(ids, expected):  # the variant routes as intended, generated tokens included
        with torch.no_grad():
            router_logits = hf(torch.tensor([p + new]), output_router_logits=True).router_logits
        assert all(set(r.topk(top_k, dim=-1).indices.unique().tolist()) <= set(range(top_k))
                   for r in router_logits)
    assert len({t for new in expected for t in new}) > 10, "the variant should not be degenerate"

    mesh = _start(one_rank_model_dir, 2)
    try:
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            assert _generate_all(stub, ids, max_workers=len(ids)) == expected
    finally:
        mesh.stop()


# ---- a bad N ---------------------------------------------------------------------------------


def test_ranks_that_do_not_divide_the_experts_are_refused_before_anything_starts(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--ranks 3 does not divide the 8 experts.*\[1, 2, 4, 8\]"):
        launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=3)
    work_dir = tmp_path / "mesh"
    out = subprocess.run([sys.executable, "-m", "moemesh.cli", "up", "--ranks", "3", "--model", str(tiny_model_dir),
                          "--port", "0", "--work-dir", str(work_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--ranks 3 does not divide the 8 experts" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not work_dir.exists(), "nothing should have started"
