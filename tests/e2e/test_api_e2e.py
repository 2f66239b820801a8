"""Abort, client cancellation, GetModelInfo, Usage.cached_tokens and n samples
through the shared mesh (tests/conftest.py), the tokens against transformers'
reference and the freed KV blocks through the gateway's metrics."""

import collections
import concurrent.futures
import dataclasses
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expert_svc.config import ExpertConfig
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


def wait_until_no_block_is_held(mesh) -> None:
    """Within 10 s: nothing runs and no block is held (cached ones without references are free)."""
    deadline = time.monotonic() + 10
    while kv_in_use(mesh) != (0.0, 0.0):
        assert time.monotonic() < deadline, kv_in_use(mesh)
        time.sleep(0.05)


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
    wait_until_no_block_is_held(mesh)
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
    assert list(info.features) == ["prefix_cache", "constraints", "logprobs", "n"]


def test_a_repeated_prompt_reports_its_cached_tokens(stub):
    prompt = "Cached tokens: the prefix of this prompt is computed once and then reused. " * 4
    usages = [list(stub.Generate(gateway_pb2.GenerateRequest(request_id=f"cached-{i}", prompt=prompt,
                                                             sampling=greedy(2)), timeout=60))[-1].usage
              for i in range(2)]
    num_prompt = usages[0].prompt_tokens
    assert usages[0].cached_tokens == 0
    assert usages[1].prompt_tokens == num_prompt and 0 < usages[1].cached_tokens < num_prompt


# The shared mesh's ranks run expert_svc's default KV block size.
BLOCK_SIZE = next(f.default for f in dataclasses.fields(ExpertConfig) if f.name == "kv_block_size")


def samples_of(responses) -> dict[int, list]:
    """The messages of each sample, by index."""
    by_index = collections.defaultdict(list)
    for response in responses:
        by_index[response.index].append(response)
    return dict(by_index)


def test_seeded_samples_are_reproducible_differ_and_prefill_their_prompt_once(mesh, stub):
    prompt = "Four samples of one prompt, which is prefilled once and shared through the prefix cache. " * 2
    n, num_new = 4, 10

    def call(request_id: str, n: int, seed: int):
        return samples_of(stub.Generate(gateway_pb2.GenerateRequest(
            request_id=request_id, prompt=prompt, sampling=gateway_pb2.SamplingParams(
                n=n, seed=seed, temperature=1.0, max_new_tokens=num_new, ignore_eos=True)), timeout=120))

    def counters() -> tuple[float, float]:
        """The gateway's prefix-cache hit tokens and copied blocks so far."""
        gauges = gateway_gauges(mesh)
        return (gauges[("moemesh_prefix_cache_hit_tokens_total", ())],
                gauges[("moemesh_prefix_cache_copied_blocks_total", ())])

    before = counters()
    first = call("samples-1", n, 1234)
    hits, copies = (after - b for after, b in zip(counters(), before))
    again = call("samples-2", n, 1234)
    third = call("samples-3", 1, 1236)
    assert sorted(first) == sorted(again) == list(range(n))
    tokens = {i: [t for m in messages for t in m.token_ids] for i, messages in first.items()}
    assert tokens == {i: [t for m in messages for t in m.token_ids] for i, messages in again.items()}
    assert len({tuple(t) for t in tokens.values()}) == n
    # Sample i draws as a request with seed + i does.
    assert [t for m in third[0] for t in m.token_ids] == tokens[2]
    for messages in first.values():
        assert [m.finish_reason for m in messages[:-1]] == [gateway_pb2.FINISH_REASON_UNSPECIFIED] * (
            len(messages) - 1)
        assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert messages[-1].usage.completion_tokens == num_new
    usages = [first[i][-1].usage for i in range(n)]
    num_prompt = usages[0].prompt_tokens
    # The first sample computed the prompt; every other one found all of it but its last token
    # cached: the full blocks in place, the rest copied from the first's partly filled block.
    num_cached = num_prompt - 1
    assert num_cached % BLOCK_SIZE and num_cached > BLOCK_SIZE
    assert [u.prompt_tokens for u in usages] == [num_prompt] * n
    assert [u.cached_tokens for u in usages] == [0] + [num_cached] * (n - 1)
    assert hits == (n - 1) * num_cached and copies == n - 1


def test_samples_with_prompt_logprobs_score_the_prompt_once_and_share_it(stub):
    prompt = "Three samples that ask for the prompt's log-probabilities, scored once by the first. " * 2
    responses = list(stub.Generate(gateway_pb2.GenerateRequest(
        request_id="samples-logprobs", prompt=prompt, sampling=gateway_pb2.SamplingParams(
            n=3, seed=7, temperature=1.0, max_new_tokens=4, ignore_eos=True, top_logprobs=2,
            prompt_logprobs=True)), timeout=120))
    by_index = samples_of(responses)
    num_prompt = by_index[0][-1].usage.prompt_tokens
    assert len(by_index[0][0].prompt_logprobs) == num_prompt - 1
    assert all(len(p.top) == 2 for p in by_index[0][0].prompt_logprobs)
    assert [m for m in responses if m.prompt_logprobs] == [by_index[0][0]]
    for messages in by_index.values():
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
        assert [lp.token_id for m in messages for lp in m.logprobs] == [t for m in messages for t in m.token_ids]
    # The first sample computed every prompt position to score it; the others took all of it but
    # its last token (its full blocks, and a copy of its partly filled one).
    num_cached = num_prompt - 1
    assert [by_index[i][-1].usage.cached_tokens for i in range(3)] == [0, num_cached, num_cached]


def test_abort_and_cancel_end_every_sample_and_free_their_blocks(mesh, stub):
    def long_call(request_id: str):
        return stub.Generate(gateway_pb2.GenerateRequest(
            request_id=request_id, prompt=f"Three long stories, told by {request_id}:",
            sampling=gateway_pb2.SamplingParams(n=3, temperature=1.0, max_new_tokens=2000, ignore_eos=True)),
            timeout=120)

    aborted, cancelled = long_call("samples-aborted"), long_call("samples-cancelled")
    first = [next(aborted), next(cancelled)]
    utilization, num_running = kv_in_use(mesh)
    assert utilization > 0 and num_running >= 2
    answer = stub.Abort(gateway_pb2.AbortRequest(request_id="samples-aborted"), timeout=10)
    rest = samples_of([first[0], *aborted])
    cancelled.cancel()
    with pytest.raises(grpc.RpcError) as gone:
        list(cancelled)
    assert gone.value.code() == grpc.StatusCode.CANCELLED
    assert answer.num_aborted == 3
    assert sorted(rest) == [0, 1, 2]
    for messages in rest.values():
        assert [m.finish_reason for m in messages[:-1]] == [gateway_pb2.FINISH_REASON_UNSPECIFIED] * (
            len(messages) - 1)
        assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_ABORT
        assert messages[-1].usage.completion_tokens == sum(len(m.token_ids) for m in messages) < 2000
    wait_until_no_block_is_held(mesh)
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(gateway_pb2.AbortRequest(request_id="samples-cancelled"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("sampling", [gateway_pb2.SamplingParams(n=17, temperature=1.0),
                                      gateway_pb2.SamplingParams(n=2, temperature=0.0)])
def test_more_than_16_samples_or_several_greedy_ones_are_refused(stub, sampling):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(gateway_pb2.GenerateRequest(request_id="bad-n", prompt="x", sampling=sampling),
                           timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("sampling.n ")
