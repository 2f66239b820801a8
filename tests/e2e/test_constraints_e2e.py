"""Structured output through the whole mesh: SamplingParams' constraint, enforced on the rank.

One batch runs every constraint kind (the issue's ticket schema, a nested schema with arrays,
enums, patterns and $ref, any JSON object, a regex, a grammar, a choice), greedy and sampled
with three seeds, together with unconstrained greedy requests, a constrained request cut by a
stop string and one cut by max_new_tokens. The shared mesh serves the tiny random model with
the real Qwen tokenizer: a weak model, so whatever text comes out is the constraint's doing.
Bad constraints get INVALID_ARGUMENT naming their field, and the mesh keeps serving.
"""

import concurrent.futures

import grpc
import pytest

from gateway.server import constraint_compiler
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.constraints import Compiler
from services.model.config import ModelConfig
from services.tokenizer import Tokenizer
from tests.conftest import hf_greedy
from tests.e2e.test_mesh_e2e import PROMPTS, generate
from tests.services.constraint_cases import CONSTRAINTS, check_output

# Enough for the nested schema's answers on the tiny model (under 100 tokens); the ticket
# schema's sampled answers end under 140.
MAX_NEW_TOKENS = 200
SEEDS = (2, 3, 4)
PROMPT = "I was charged twice for order ORD-123456 between 2024-01-01 and 2024-01-31. Refund me 20 dollars."
UNCONSTRAINED_TOKENS = 24


def constraint_params(name: str) -> dict:
    """SamplingParams' constraint fields for CONSTRAINTS[name]."""
    constraint = CONSTRAINTS[name]
    if constraint.kind == "choice":
        return {"choice": gateway_pb2.Choice(options=constraint.text)}
    if constraint.kind == "json_object":
        return {"json_object": True}
    return {constraint.kind: constraint.text}


def constrained_request(name: str, seed: int | None, **sampling) -> gateway_pb2.GenerateRequest:
    params = gateway_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, **constraint_params(name), **sampling)
    if seed is not None:
        params.temperature, params.seed = 1.0, seed
    request = gateway_pb2.GenerateRequest(request_id=f"{name}-{seed}", sampling=params)
    request.messages.messages.add(role="user", content=PROMPT)
    return request


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> Compiler:
    """The gateway's Compiler: to check that every token of an answer was allowed."""
    return constraint_compiler(ModelConfig.from_model_dir(tiny_model_dir), Tokenizer.from_model_dir(tiny_model_dir))


@pytest.fixture(scope="module")
def batch(stub):
    """Every request of the batch, sent at once: request id -> (request, (token_ids, text, last))."""
    requests = [constrained_request(name, seed) for name in CONSTRAINTS for seed in (None, *SEEDS)]
    # A stop string ends a constrained output early (here before the regex's first space).
    requests.append(constrained_request("regex", None, stop=[" "]))
    requests[-1].request_id = "regex-stop"
    requests.append(constrained_request("nested", None))
    requests[-1].request_id, requests[-1].sampling.max_new_tokens = "nested-length", 5
    requests += [gateway_pb2.GenerateRequest(
        request_id=f"free-{i}", prompt=prompt,
        sampling=gateway_pb2.SamplingParams(max_new_tokens=UNCONSTRAINED_TOKENS, ignore_eos=True))
        for i, prompt in enumerate(PROMPTS[:3])]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = pool.map(lambda r: generate(stub, r), requests)
        return {r.request_id: (r, result) for r, result in zip(requests, results)}


def assert_inside(compiler: Compiler, name: str, token_ids: list[int]) -> None:
    """Every token is one the constraint allowed after the ones before it."""
    compiler.matcher(CONSTRAINTS[name], token_ids)


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_constrained_answers_finish_and_satisfy_their_constraint(batch, compiler, name):
    for seed in (None, *SEEDS):
        _, (token_ids, text, last) = batch[f"{name}-{seed}"]
        assert last.finish_reason == gateway_pb2.FINISH_REASON_STOP, (seed, text)
        assert not last.matched_stop and len(token_ids) < MAX_NEW_TOKENS
        assert token_ids[-1] in compiler.eos_token_ids
        check_output(name, text)
        assert_inside(compiler, name, token_ids)


def test_sampled_answers_differ_by_seed(batch):
    for name in ("ticket", "nested", "regex", "grammar"):
        texts = {batch[f"{name}-{seed}"][1][1] for seed in SEEDS}
        assert len(texts) == len(SEEDS), (name, texts)


def test_unconstrained_greedy_requests_in_the_same_steps_match_transformers(batch, stub, hf_model):
    for i, prompt in enumerate(PROMPTS[:3]):
        _, (token_ids, _, last) = batch[f"free-{i}"]
        prompt_ids = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=prompt), timeout=10).token_ids)
        assert token_ids == hf_greedy(hf_model, prompt_ids, UNCONSTRAINED_TOKENS), prompt
        assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH


def test_a_stop_string_ends_a_constrained_answer_early(batch, compiler):
    _, (_, full_text, _) = batch["regex-None"]
    _, (token_ids, text, last) = batch["regex-stop"]
    assert last.finish_reason == gateway_pb2.FINISH_REASON_STOP and last.matched_stop == " "
    assert text == full_text[:full_text.index(" ")] and token_ids[-1] not in compiler.eos_token_ids


def test_max_new_tokens_cuts_a_constrained_answer_with_length(batch, compiler):
    _, (token_ids, text, last) = batch["nested-length"]
    _, (_, full_text, _) = batch["nested-None"]
    assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH and len(token_ids) == 5
    assert full_text.startswith(text) and text.startswith('{"status": ')
    assert_inside(compiler, "nested", token_ids)


BAD_CONSTRAINTS = [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": "strin"}}}'}, "sampling.json_schema"),
    ({"json_schema": "{not json"}, "sampling.json_schema"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "sampling.json_schema"),
    ({"json_schema": '{"$ref": "#/$defs/nowhere"}'}, "sampling.json_schema"),
    ({"json_object": False}, "sampling.json_object"),
    ({"regex": "(unclosed"}, "sampling.regex"),
    ({"grammar": "start: missing_rule"}, "sampling.grammar"),
    ({"choice": gateway_pb2.Choice()}, "sampling.choice"),
    ({"choice": gateway_pb2.Choice(options=["a", ""])}, "sampling.choice"),
    ({"regex": "[0-9]+", "ignore_eos": True}, "sampling.ignore_eos"),
]


@pytest.mark.parametrize("params, field", BAD_CONSTRAINTS, ids=[f for _, f in BAD_CONSTRAINTS])
def test_a_bad_constraint_is_refused_naming_its_field_and_the_mesh_keeps_serving(stub, params, field):
    request = gateway_pb2.GenerateRequest(request_id="bad", prompt="Hello",
                                          sampling=gateway_pb2.SamplingParams(max_new_tokens=8, **params))
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field + " "), err.value.details()
    _, text, last = generate(stub, gateway_pb2.GenerateRequest(
        request_id="good", prompt="Hello", sampling=gateway_pb2.SamplingParams(
            max_new_tokens=16, choice=gateway_pb2.Choice(options=["yes", "no"]))))
    assert last.finish_reason == gateway_pb2.FINISH_REASON_STOP and text in ("yes", "no")


def test_jump_forward_appended_forced_tokens_without_a_step_each(batch, mesh):
    """The schemas' keys and punctuation came as jump-forward chunks: the gateway counts them."""
    import urllib.request

    gateway = next(r for r in mesh.roles if r.name.startswith("gateway"))
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    (line,) = [x for x in lines if x.startswith("moemesh_jump_forward_tokens_total ")]
    # The ticket answers alone force ', "amount": ' and more: several chunks of 2+ tokens each.
    assert float(line.split()[1]) >= 10
