"""Abort, client cancellation, GetModelInfo and Usage.cached_tokens through the
shared mesh (tests/conftest.py), the tokens against transformers' reference
and the freed KV blocks through the gateway's metrics."""

import concurrent.futures
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.model.config import ModelConfig
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def greedy(n: int) -> gateway_pb2.SamplingParams:
    return gateway_pb2.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def gateway_gauges(mesh) -> dict[tuple[str, tuple], float]:
    """The gateway's /metrics samples, as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.gateway.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def kv_in_use(mesh) -> tuple[float, float]:
    """(KV utilization of rank 0, running sequences) as the gateway reports them."""
    gauges = gateway_gauges(mesh)
    return (gauges[("moemesh_kv_cache_utilization_ratio", (("rank", "0"),))],
            gauges[("moemesh_num_requests_running", ())])


def test_abort_and_cancel_end_their_streams_free_their_blocks_and_leave_another_untouched(mesh, stub, hf_model):
    def long_call(request_id: str):
        return stub.Generate(gateway_pb2.GenerateRequest(
            request_id=request_id, prompt=f"A long story, told by {request_id}:", sampling=greedy(2000)), timeout=120)

    aborted, cancelled = long_call("api-aborted"), long_call("api-cancelled")
    first = [next(aborted), next(cancelled)]
    other = gateway_pb2.GenerateRequest(request_id="api-other", prompt="The sea was calm that night",
                                        sampling=greedy(24))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other_call = pool.submit(lambda: list(stub.Generate(other, timeout=120)))
        utilization, num_running = kv_in_use(mesh)
        assert utilization > 0 and num_running >= 2
        answer = stub.Abort(gateway_pb2.AbortRequest(request_id="api-aborted"), timeout=10)
        rest = list(aborted)
        cancelled.cancel()
        other_responses = other_call.result()
    assert answer.num_aborted == 1
    assert rest[-1].finish_reason == gateway_pb2.FINISH_REASON_ABORT
    assert 0 < rest[-1].usage.completion_tokens < 2000
    assert rest[-1].usage.completion_tokens == sum(len(r.token_ids) for r in [first[0], *rest])
    with pytest.raises(grpc.RpcError) as gone:
        list(cancelled)
    assert gone.value.code() == grpc.StatusCode.CANCELLED

    prompt_ids = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=other.prompt), timeout=10).token_ids)
    assert [t for r in other_responses for t in r.token_ids] == hf_greedy(hf_model, prompt_ids, 24)
    assert other_responses[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH

    # Both long requests' blocks are back: nothing runs and no block is held.
    deadline = time.monotonic() + 10
    while kv_in_use(mesh) != (0.0, 0.0):
        assert time.monotonic() < deadline, kv_in_use(mesh)
        time.sleep(0.05)
    for request_id, code in (("api-aborted", grpc.StatusCode.NOT_FOUND), ("api-cancelled", grpc.StatusCode.NOT_FOUND),
                             ("", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(gateway_pb2.AbortRequest(request_id=request_id), timeout=10)
        assert err.value.code() == code, request_id


def test_get_model_info_matches_the_model_config(stub, tiny_model_dir):
    model = ModelConfig.from_model_dir(tiny_model_dir)
    info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
    assert info.model_name == tiny_model_dir.name
    assert info.architecture == "Qwen3MoeForCausalLM"
    assert info.context_length == model.max_position_embeddings
    assert info.vocab_size == model.vocab_size
    assert info.dtype == str(model.dtype).removeprefix("torch.")
    assert (info.num_experts, info.num_experts_per_tok) == (model.num_experts, model.num_experts_per_tok)
    assert info.num_ranks == 1
    assert list(info.features) == ["prefix_cache", "constraints", "logprobs"]


def test_a_repeated_prompt_reports_its_cached_tokens(stub):
    prompt = "Cached tokens: the prefix of this prompt is computed once and then reused. " * 4
    usages = [list(stub.Generate(gateway_pb2.GenerateRequest(request_id=f"cached-{i}", prompt=prompt,
                                                             sampling=greedy(2)), timeout=60))[-1].usage
              for i in range(2)]
    num_prompt = usages[0].prompt_tokens
    assert usages[0].cached_tokens == 0
    assert usages[1].prompt_tokens == num_prompt and 0 < usages[1].cached_tokens < num_prompt
