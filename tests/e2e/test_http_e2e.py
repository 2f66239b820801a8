"""The OpenAI-compatible HTTP endpoint of the shared mesh, driven by the official `openai` package.

Completions and chat, streaming and not, stop strings, usage, n seeded samples, response_format
(json_object, json_schema), and bad input with its status and error shape; the
greedy tokens through HTTP are those through gRPC (vLLM's return_token_ids
gives them). The 503 of a gateway without a group is tests/gateway/http's.
"""

import json
import pathlib
import re
import urllib.request

import grpc
import openai
import pytest

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.test_constraints_e2e import PROMPT as TICKET_PROMPT
from tests.e2e.test_mesh_e2e import CHATS, PROMPTS, generate
from tests.services.constraint_cases import CONSTRAINTS, NESTED_SCHEMA, check_output

NUM_TOKENS = 12
# Enough for the tiny model's constrained answers to finish (tests/e2e/test_constraints_e2e.py).
MAX_CONSTRAINED_TOKENS = 200


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.http_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    [served] = client.models.list().data
    return served.id


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def grpc_greedy(stub, *, prompt=None, messages=None, num_tokens=NUM_TOKENS, **sampling):
    request = gateway_pb2.GenerateRequest(request_id="grpc", sampling=gateway_pb2.SamplingParams(
        max_new_tokens=num_tokens, temperature=0.0, **sampling))
    if messages is None:
        request.prompt = prompt
    else:
        request.messages.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    return generate(stub, request)


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_completions_through_http_are_the_grpc_tokens(client, model, stub, prompt):
    token_ids, text, last = grpc_greedy(stub, prompt=prompt, ignore_eos=True)
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    [choice] = completion.choices
    assert choice.model_extra["token_ids"] == token_ids and choice.text == text
    assert choice.finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == \
        (last.usage.prompt_tokens, NUM_TOKENS)
    assert completion.usage.total_tokens == last.usage.prompt_tokens + NUM_TOKENS


def test_a_prompt_of_token_ids_is_used_as_it_is(client, model, stub):
    prompt_ids = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=PROMPTS[1]), timeout=10).token_ids)
    by_text = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(prompt_ids)


def test_chat_streamed_and_not_is_the_grpc_answer_with_usage(client, model, stub):
    messages = CHATS[1]
    token_ids, text, last = grpc_greedy(stub, messages=messages, ignore_eos=True)
    body = [{"role": r, "content": c} for r, c in messages]
    chat = client.chat.completions.create(model=model, messages=body, max_completion_tokens=NUM_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=model, messages=body, max_tokens=NUM_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == last.usage.prompt_tokens and chat.usage.completion_tokens == NUM_TOKENS
    *content, usage = chunks
    assert "".join(c.choices[0].delta.content for c in content) == text
    assert [t for c in content for t in c.choices[0].model_extra["token_ids"]] == token_ids
    assert content[0].choices[0].delta.role == "assistant" and content[-1].choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == NUM_TOKENS


def test_a_streamed_completion_is_the_whole_one_in_pieces(client, model):
    whole = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_a_stop_string_ends_the_answer_before_it(client, model, stub):
    _, full, _ = grpc_greedy(stub, prompt=PROMPTS[3], num_tokens=24, ignore_eos=True)
    stop = full[8:11]
    completion = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                           stop=[stop, "never seen"], extra_body={"ignore_eos": True})
    assert completion.choices[0].text == full[:full.index(stop)]
    assert completion.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


@pytest.mark.parametrize("name, response_format", [
    ("json_object", {"type": "json_object"}),
    ("nested", {"type": "json_schema", "json_schema": {"name": "nested", "schema": NESTED_SCHEMA}}),
])
def test_response_format_constrains_the_answer_as_the_grpc_constraint(client, model, stub, name, response_format):
    constraint = CONSTRAINTS[name]
    sampling = {"json_object": True} if constraint.kind == "json_object" else {"json_schema": constraint.text}
    _, text, _ = grpc_greedy(stub, messages=[("user", TICKET_PROMPT)], num_tokens=MAX_CONSTRAINED_TOKENS,
                             **sampling)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": TICKET_PROMPT}],
                                          max_tokens=MAX_CONSTRAINED_TOKENS, temperature=0,
                                          response_format=response_format)
    answer = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and answer == text
    check_output(name, answer)
    assert isinstance(json.loads(answer), dict)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 10_000_000}, "max_tokens"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"extra_body": {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                 "uniqueItems": True}}}}},
     "response_format"),
    ({"extra_body": {"echo": True}}, "echo"),
])
def test_bad_completions_are_400_naming_the_parameter_and_the_mesh_keeps_serving(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="Hello", **{"max_tokens": 4, **kwargs})
    body = error.value.body
    assert error.value.status_code == 400 and body["param"] == param and body["type"] == "invalid_request_error"
    assert set(body) == {"message", "type", "param", "code"} and param in body["message"]
    assert client.completions.create(model=model, prompt="Hello", max_tokens=2).choices[0].finish_reason


def test_bad_chat_input_and_an_unknown_model(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=[])
    assert error.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], top_logprobs=3)
    assert error.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="not-" + model, messages=[{"role": "user", "content": "x"}])
    assert error.value.body["code"] == "model_not_found"


def test_models_and_health(client, model, mesh, tiny_model_dir):
    [served] = client.models.list().data
    assert served.id == tiny_model_dir.name and served.owned_by == "moemesh"
    with urllib.request.urlopen(mesh.http_url.removesuffix("/v1") + "/health", timeout=10) as health:
        assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}
    state = json.loads((mesh.work_dir / "mesh.json").read_text())
    assert state["http"] == mesh.http_url


def test_the_readme_openai_example_runs(mesh, capsys):
    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    [example] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "from openai" in block]
    exec(example.replace("http://127.0.0.1:8000/v1", mesh.http_url), {})
    assert capsys.readouterr().out.strip()


def test_n_seeded_samples_are_the_grpc_samples_by_index(client, model, stub):
    request = gateway_pb2.GenerateRequest(request_id="n-grpc", prompt=PROMPTS[1], sampling=gateway_pb2.SamplingParams(
        max_new_tokens=NUM_TOKENS, temperature=1.0, seed=7, n=3, ignore_eos=True))
    texts = {}
    for response in stub.Generate(request, timeout=120):
        texts[response.index] = texts.get(response.index, "") + response.text
    completion = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=NUM_TOKENS, temperature=1.0,
                                           seed=7, n=3, extra_body={"ignore_eos": True})
    assert {c.index: c.text for c in completion.choices} == texts and len(set(texts.values())) == 3
    assert completion.usage.completion_tokens == 3 * NUM_TOKENS
    stream = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=NUM_TOKENS, temperature=1.0,
                                       seed=7, n=3, stream=True, extra_body={"ignore_eos": True})
    streamed, finished = {}, {}
    for chunk in stream:
        [choice] = chunk.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        finished[choice.index] = choice.finish_reason
    assert streamed == texts and finished == {0: "length", 1: "length", 2: "length"}
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0, n=2)
    assert error.value.body["param"] == "n"


def test_logprobs_through_http_are_the_grpc_ones(client, model, stub):
    """Completions' logprobs object and chat's logprobs.content carry the values the gRPC API reports."""
    def grpc_logprobs(request: gateway_pb2.GenerateRequest):
        request.sampling.MergeFrom(gateway_pb2.SamplingParams(
            max_new_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, top_logprobs=3))
        entries = [lp for r in stub.Generate(request, timeout=60) for lp in r.logprobs]
        assert len(entries) == NUM_TOKENS
        return entries

    expected = grpc_logprobs(gateway_pb2.GenerateRequest(prompt=PROMPTS[0]))
    completion = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=NUM_TOKENS, temperature=0,
                                           logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    [choice] = completion.choices
    assert choice.model_extra["token_ids"] == [lp.token_id for lp in expected]
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-6)
    assert len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs) == NUM_TOKENS
    assert all(max(top.values()) == pytest.approx(lp.top[0].logprob, abs=1e-6)
               for top, lp in zip(choice.logprobs.top_logprobs, expected))

    messages = CHATS[1]
    expected = grpc_logprobs(gateway_pb2.GenerateRequest(messages=gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages])))
    chat = client.chat.completions.create(
        model=model, messages=[{"role": r, "content": c} for r, c in messages], max_tokens=NUM_TOKENS,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-6)
    assert [[t.logprob for t in c.top_logprobs] for c in content] == \
        [pytest.approx([t.logprob for t in lp.top], abs=1e-6) for lp in expected]
