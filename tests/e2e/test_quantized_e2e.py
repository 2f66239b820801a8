"""Quantized checkpoints through the whole mesh on the CPU: block FP8 and AWQ 4-bit test
checkpoints whose hidden size (160) is not a multiple of 128 give exactly the greedy tokens of
transformers fp32 on their dequantized weights, at 1 and 2 ranks.

One checkpoint (and one transformers reference) per format; one mesh per format and rank
count, started once for the module's tests. Steps of more than 16 tokens per rank dispatch
with host splits, the rest (decode) at a fixed capacity, so both dispatch modes run.
"""

import concurrent.futures

import grpc
import pytest
import torch

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from services.model.make_model import PRESETS, awq_group_size, make_random_checkpoint, write_dequantized_checkpoint
from services.model.quant.formats import QuantConfig
from tests.conftest import TEST_MODEL_SEED, hf_greedy
from tests.e2e.test_mesh_e2e import generate, greedy

NUM_NEW_TOKENS = 10
PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Block FP8 stores one scale per 128 by 128 block; AWQ stores one per group of in-features.",
    "Q: Why is the gate never quantized?\nA:",
]
EXPERT_ARGS = ["--max-fixed-capacity-tokens", "16"]
PRESET = PRESETS["tiny-h160"]


@pytest.fixture(scope="module", params=["fp8", "awq"])
def checkpoints(request, cache_dir):
    """(the quantized checkpoint, its dequantized fp32 twin): the tiny-h160 preset with the real
    vocabulary and tokenizer, unquantized tensors in bf16 as published."""
    quant = QuantConfig("fp8") if request.param == "fp8" else QuantConfig("awq", awq_group_size(PRESET))
    root = cache_dir / "models" / f"tiny-h160-{request.param}-seed{TEST_MODEL_SEED}"
    if not (root / "dense" / "config.json").is_file():
        make_random_checkpoint(root / "quantized", PRESET, seed=TEST_MODEL_SEED, dtype=torch.bfloat16, quant=quant)
        write_dequantized_checkpoint(root / "quantized", root / "dense")
    return root / "quantized", root / "dense"


@pytest.fixture(scope="module")
def expected(checkpoints):
    """(prompt ids, transformers' greedy tokens of each) on the dequantized twin."""
    from transformers import Qwen3MoeForCausalLM

    from services.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(checkpoints[1])
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in prompt_ids) > 16 > min(len(i) for i in prompt_ids)
    hf = Qwen3MoeForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    return prompt_ids, [hf_greedy(hf, ids, NUM_NEW_TOKENS) for ids in prompt_ids]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"N{n}")
def stub(request, checkpoints):
    spec = launcher.MeshSpec(model_dir=str(checkpoints[0]), num_ranks=request.param, device="cpu",
                             extra_args={"expert_svc": EXPERT_ARGS})
    with launcher.Mesh(spec) as mesh, grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def test_concurrent_requests_give_the_greedy_tokens_of_transformers_on_the_dequantized_weights(stub, expected):
    prompt_ids, tokens = expected
    assert len({t for new in tokens for t in new}) > 5, "the reference should not be degenerate"

    def one(i: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(request_id=f"q{i}", input_ids=gateway_pb2.TokenIds(ids=prompt_ids[i]),
                                              sampling=greedy(n=NUM_NEW_TOKENS))
        return generate(stub, request)[0]

    with concurrent.futures.ThreadPoolExecutor(len(prompt_ids)) as pool:
        assert list(pool.map(one, range(len(prompt_ids)))) == tokens
    assert generate(stub, gateway_pb2.GenerateRequest(
        request_id="alone", input_ids=gateway_pb2.TokenIds(ids=prompt_ids[2]),
        sampling=greedy(n=NUM_NEW_TOKENS)))[0] == tokens[2]
