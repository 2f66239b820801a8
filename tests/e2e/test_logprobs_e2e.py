"""Log-probabilities through the whole mesh against transformers (fp32, same checkpoint):
prompt and generated tokens' log-probabilities and the top alternatives within 1e-4, at 1
rank (the shared mesh) and 2 ranks (prefill in chunks of 16 tokens, so the prompt's
log-probabilities cross chunk boundaries), with requests running concurrently."""

import concurrent.futures

import grpc
import pytest
import torch

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from moemesh import launcher
from tests.conftest import hf_greedy, hf_logprobs
from tests.e2e.test_mesh_e2e import greedy

NUM_NEW_TOKENS = 6
NUM_TOP = 5
TOL = 1e-4
PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route each token to a few experts of every layer. " * 3,
]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"N{n}")
def stub(request, tiny_model_dir):
    """A gateway stub of a mesh of N ranks (N = 1: the shared mesh)."""
    own = request.param > 1
    if own:
        spec = launcher.MeshSpec(model_dir=str(tiny_model_dir), num_ranks=request.param, device="cpu",
                                 extra_args={"gateway": ["--prefill-chunk-size", "16"]})
        mesh = launcher.Mesh(spec).start()
    else:
        mesh = request.getfixturevalue("mesh")
    try:
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            yield gateway_pb2_grpc.GenerationServiceStub(channel)
    finally:
        if own:
            mesh.stop()


def _stream(stub, request) -> list[gateway_pb2.GenerateResponse]:
    return list(stub.Generate(request, timeout=120))


def _check(entries, reference_LV: torch.Tensor, token_ids: list[int], positions: range) -> None:
    """entries[i] is the token at positions[i]: its id, its log-probability and the top NUM_TOP."""
    assert len(entries) == len(positions)
    for entry, position in zip(entries, positions):
        ref_V = reference_LV[position - 1]
        assert entry.token_id == token_ids[position]
        assert entry.logprob == pytest.approx(ref_V[entry.token_id].item(), abs=TOL)
        values, ids = ref_V.topk(NUM_TOP)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=TOL)


def test_logprobs_equal_transformers_log_softmax(stub, hf_model):
    prompt_ids = [list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=p), timeout=10).token_ids) for p in PROMPTS]

    def one(i: int) -> list[gateway_pb2.GenerateResponse]:
        return _stream(stub, gateway_pb2.GenerateRequest(
            request_id=f"lp{i}", input_ids=gateway_pb2.TokenIds(ids=prompt_ids[i]),
            sampling=greedy(n=NUM_NEW_TOKENS, top_logprobs=NUM_TOP, prompt_logprobs=True)))

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(one, range(len(PROMPTS))))
    for ids, messages in zip(prompt_ids, streams):
        generated = [t for m in messages for t in m.token_ids]
        assert generated == hf_greedy(hf_model, ids, NUM_NEW_TOKENS)
        full = ids + generated
        reference_LV = hf_logprobs(hf_model, full)
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
        _check([lp for m in messages for lp in m.logprobs], reference_LV, full, range(len(ids), len(full)))
        _check(messages[0].prompt_logprobs, reference_LV, full, range(1, len(ids)))
        assert not any(m.prompt_logprobs for m in messages[1:])
        assert messages[-1].usage.cached_tokens == 0


def test_a_drawn_token_reports_the_raw_logits_log_softmax(stub, hf_model):
    """At temperature 1.5 with top_k 10 the token is drawn, but its log-probability is still
    the untempered, unfiltered log-softmax."""
    request = gateway_pb2.GenerateRequest(request_id="drawn", prompt=PROMPTS[1], sampling=gateway_pb2.SamplingParams(
        max_new_tokens=NUM_NEW_TOKENS, temperature=1.5, top_k=10, seed=3, ignore_eos=True, logprobs=True))
    messages = _stream(stub, request)
    ids = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=PROMPTS[1]), timeout=10).token_ids)
    full = ids + [t for m in messages for t in m.token_ids]
    entries = [lp for m in messages for lp in m.logprobs]
    reference_LV = hf_logprobs(hf_model, full)
    assert [e.token_id for e in entries] == full[len(ids):] and not any(e.top for e in entries)
    for entry, position in zip(entries, range(len(ids), len(full))):
        assert entry.logprob == pytest.approx(reference_LV[position - 1][entry.token_id].item(), abs=TOL)


def test_prompt_logprobs_start_scores_its_positions_on_the_cached_prefix(stub, hf_model):
    """A long shared context, then a continuation scored from its first token: the positions and values
    are those a full prompt_logprobs request reports for them (and transformers'), and once the context
    is cached the scoring request takes all of it before the start (its full blocks in place, the
    rest through a copy of the context's last, partly filled block)."""
    context = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=PROMPTS[2]), timeout=10).token_ids)
    tail = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=" Routing is cheap."), timeout=10).token_ids)
    ids, start = context + tail, len(context)
    assert start > 2 * 16  # full KV blocks of 16 before the start

    def scored(request_id: str, **sampling) -> list[gateway_pb2.GenerateResponse]:
        return _stream(stub, gateway_pb2.GenerateRequest(
            request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=ids),
            sampling=greedy(n=2, top_logprobs=NUM_TOP, prompt_logprobs=True, **sampling)))

    full = scored("start-full")
    # The context alone first: its blocks cached, its last partly filled one as a tail once it ends.
    _stream(stub, gateway_pb2.GenerateRequest(request_id="start-warm", input_ids=gateway_pb2.TokenIds(ids=context),
                                              sampling=greedy(n=1)))
    part = scored("start-part", prompt_logprobs_start=start)
    assert full[-1].usage.cached_tokens == 0
    assert part[-1].usage.cached_tokens == start - 1 and (start - 1) % 16
    same_positions = list(full[0].prompt_logprobs)[start - 1:]
    assert [lp.token_id for lp in part[0].prompt_logprobs] == [lp.token_id for lp in same_positions]
    assert [lp.logprob for lp in part[0].prompt_logprobs] == pytest.approx(
        [lp.logprob for lp in same_positions], abs=TOL)
    _check(part[0].prompt_logprobs, hf_logprobs(hf_model, ids), ids, range(start, len(ids)))
    assert [t for m in part for t in m.token_ids] == [t for m in full for t in m.token_ids]
