"""The gateway's scheduler through a real mesh (2 ranks, tiny model) against transformers.

The mesh runs with small limits so that every mechanism is exercised: 8-token
prefill chunks, a 24-token step budget, and a KV pool of 24 blocks of 4 tokens
per rank (96 tokens), so concurrent requests preempt each other and cached
prefixes are evicted. Every greedy output must still equal transformers'
reference; the gateway's stats file shows the prefix-cache hits and the
preemptions really happened.
"""

import concurrent.futures
import json
import random
import time

import grpc
import pytest

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from tests.conftest import hf_greedy

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def small_mesh(tiny_model_dir, tmp_path_factory):
    stats_path = tmp_path_factory.mktemp("batching") / "gateway-stats.json"
    spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=2, extra_args={
        "gateway": ["--prefill-chunk-size", "8", "--max-batch-tokens", "24", "--max-running-requests", "4",
                    "--stats-file", str(stats_path), "--stats-interval-s", "0.1"],
        "expert_svc": ["--kv-blocks", "24", "--kv-block-size", "4"],
    })
    with launcher.Mesh(spec) as mesh:
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            yield gateway_pb2_grpc.GenerationServiceStub(channel), stats_path


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def generate(stub, prompt_ids: list[int], num_new: int = NEW_TOKENS, timeout: float = 120) -> list[int]:
    request = gateway_pb2.GenerateRequest(
        request_id=f"p{len(prompt_ids)}-{prompt_ids[-1]}", input_ids=gateway_pb2.TokenIds(ids=prompt_ids),
        sampling=gateway_pb2.SamplingParams(max_new_tokens=num_new, temperature=0.0, ignore_eos=True))
    return [t for response in stub.Generate(request, timeout=timeout) for t in response.token_ids]


def generate_all(stub, prompts: list[list[int]], num_new: int = NEW_TOKENS) -> list[list[int]]:
    """All prompts at once, as concurrent streams."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(stub, p, num_new), prompts))


def gateway_stats(stats_path) -> dict:
    time.sleep(0.3)  # the gateway rewrites the file every 0.1 s
    return json.loads(stats_path.read_text())


PROMPTS = [random_prompt(random.Random(n), n) for n in (3, 9, 17, 26, 40)]


def test_chunked_prefill_batched_and_one_at_a_time_match_transformers(small_mesh, hf_model):
    stub, _ = small_mesh
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]
    assert [generate(stub, p) for p in PROMPTS] == expected
    assert generate_all(stub, PROMPTS) == expected


def test_preemption_on_a_tiny_pool_completes_every_request_with_the_reference(small_mesh, hf_model):
    stub, stats_path = small_mesh
    before = gateway_stats(stats_path)
    # 8 requests of 30 + 24 tokens (14 blocks each) on two pools of 24 blocks.
    prompts = [random_prompt(random.Random(100 + i), 30) for i in range(8)]
    assert generate_all(stub, prompts, 24) == [hf_greedy(hf_model, p, 24) for p in prompts]
    after = gateway_stats(stats_path)
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["num_recomputed_tokens"] > before["num_recomputed_tokens"]


def test_a_shared_prefix_is_reused_with_identical_outputs(small_mesh, hf_model):
    stub, stats_path = small_mesh
    rng = random.Random(7)
    system = random_prompt(rng, 24)
    prompts = [system + random_prompt(rng, 4) for _ in range(4)]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    before = gateway_stats(stats_path)
    assert generate(stub, prompts[0]) == expected[0]
    assert generate_all(stub, prompts[1:]) == expected[1:]
    after = gateway_stats(stats_path)
    hits = after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"]
    assert hits >= 3 * 24 // 2, hits
    assert 0 < after["prefix_hit_rate"] < 1


def test_outputs_stay_correct_after_the_small_pool_evicted_cached_prefixes(small_mesh, hf_model):
    stub, _ = small_mesh
    for i in range(6):                       # fills the pool with other prefixes several times over
        generate(stub, random_prompt(random.Random(200 + i), 40), 2)
    again = PROMPTS[-1]
    assert generate(stub, again) == hf_greedy(hf_model, again, NEW_TOKENS)


def test_a_request_past_its_deadline_gets_deadline_exceeded_and_the_mesh_serves_on(small_mesh, hf_model):
    stub, _ = small_mesh
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, PROMPTS[0], 2000, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert generate(stub, PROMPTS[1]) == hf_greedy(hf_model, PROMPTS[1], NEW_TOKENS)
