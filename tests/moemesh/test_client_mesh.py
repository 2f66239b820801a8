"""moemesh.Client, AsyncClient and `moemesh generate` against the shared running mesh (tests/conftest.py).

Greedy tokens against transformers' reference, the stream against the
whole result, tokenize, chat messages, abort, model info, the gateway's
INVALID_ARGUMENT mapped to a typed error naming the field, and deadlines.
"""

import asyncio
import dataclasses
import pathlib
import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import moemesh
from moemesh import cli
from services.model.config import ModelConfig
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def client(mesh):
    with moemesh.Client(mesh.gateway_address, timeout=120) as client:
        yield client


def test_generate_and_stream_give_the_reference_tokens(client, hf_model):
    prompt = "The client asks the mesh"
    result = client.generate(prompt, max_new_tokens=8, ignore_eos=True, request_id="client-greedy")
    prompt_ids = client.tokenize(prompt)
    assert list(result.token_ids) == hf_greedy(hf_model, prompt_ids, 8)
    assert result.request_id == "client-greedy" and result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 8)
    assert len(result.samples) == 1 and result.samples[0].usage == result.usage

    chunks = list(client.stream(input_ids=prompt_ids, max_new_tokens=8, ignore_eos=True))
    assert all(isinstance(c, moemesh.Chunk) and c.index == 0 for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == list(result.token_ids)
    assert "".join(c.text for c in chunks) == result.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length"
    # The same prompt again: all of it but its last token (computed for its logits) is cached now.
    assert chunks[-1].usage == dataclasses.replace(result.usage, cached_tokens=len(prompt_ids) - 1)


def test_chat_messages_as_dicts_or_pairs(client):
    as_dicts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    as_pairs = [("system", "Be brief."), ("user", "Hi")]
    ids = client.tokenize(messages=as_dicts)
    assert ids == client.tokenize(messages=as_pairs) and len(ids) > len(client.tokenize("Be brief. Hi"))
    first = client.generate(messages=as_dicts, max_new_tokens=4, ignore_eos=True)
    assert first.token_ids == client.generate(input_ids=ids, max_new_tokens=4, ignore_eos=True).token_ids


def test_the_async_client_gives_the_same_tokens(client, mesh):
    expected = client.generate("Asynchronously", max_new_tokens=6, ignore_eos=True)

    async def run():
        async with moemesh.AsyncClient(mesh.gateway_address, timeout=120) as aclient:
            result = await aclient.generate("Asynchronously", max_new_tokens=6, ignore_eos=True)
            chunks = [c async for c in aclient.stream("Asynchronously", max_new_tokens=6, ignore_eos=True)]
            return result, chunks, await aclient.model_info(), await aclient.tokenize("Asynchronously")

    result, chunks, info, ids = asyncio.run(run())
    assert result.token_ids == expected.token_ids and result.text == expected.text
    assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
    assert info.num_ranks == 1 and ids == client.tokenize("Asynchronously")


def test_abort_ends_the_stream_and_unknown_ids_are_not_found(client):
    stream = client.stream("A long story:", max_new_tokens=2000, ignore_eos=True, request_id="client-abort")
    first = next(stream)
    assert client.abort("client-abort") == 1
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens == sum(len(c.token_ids) for c in [first, *rest]) < 2000
    with pytest.raises(moemesh.NotFoundError):
        client.abort("client-abort")
    with pytest.raises(moemesh.InvalidArgumentError) as err:
        client.abort("")
    assert err.value.field == "request_id"


def num_running(mesh) -> float:
    """The gateway's running requests, from its /metrics."""
    url = f"http://127.0.0.1:{mesh.gateway.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    [value] = [s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "moemesh_num_requests_running"]
    return value


def test_closing_a_stream_cancels_its_request(client, mesh):
    stream = client.stream("Another long story:", max_new_tokens=2000, ignore_eos=True, request_id="client-closed")
    next(stream)
    assert num_running(mesh) == 1
    stream.close()
    # Nobody aborts it: the cancellation alone ends the request on the gateway.
    deadline = time.monotonic() + 10
    while num_running(mesh):
        assert time.monotonic() < deadline, "the closed stream's request is still running"
        time.sleep(0.05)
    with pytest.raises(moemesh.NotFoundError):
        client.abort("client-closed")


def test_model_info(client, tiny_model_dir):
    model = ModelConfig.from_model_dir(tiny_model_dir)
    info = client.model_info()
    assert isinstance(info, moemesh.ModelInfo)
    assert (info.model_name, info.architecture, info.vocab_size) == \
        (tiny_model_dir.name, "Qwen3MoeForCausalLM", model.vocab_size)
    assert (info.num_experts, info.num_experts_per_tok, info.num_ranks) == \
        (model.num_experts, model.num_experts_per_tok, 1)
    assert info.context_length == model.max_position_embeddings and "constraints" in info.features


@pytest.mark.parametrize(("options", "field"), [
    (dict(top_k=10**9), "sampling.top_k"),
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(stop=["ok", ""]), "sampling.stop[1]"),
    (dict(regex="(unclosed"), "sampling.regex"),
    (dict(json_schema={"type": "object", "not": {}}), "sampling.json_schema"),
    (dict(choice=[]), "sampling.choice"),
])
def test_invalid_arguments_raise_a_typed_error_naming_the_field(client, options, field):
    with pytest.raises(moemesh.InvalidArgumentError) as err:
        client.generate("Hi", max_new_tokens=4, **options)
    assert err.value.code.name == "INVALID_ARGUMENT" and err.value.field == field, err.value.details
    assert not err.value.after_first_token


def test_a_constraint_given_as_a_dict_is_enforced(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    result = client.generate("Answer in JSON:", max_new_tokens=32, json_schema=schema)
    assert result.finish_reason == "stop" and result.text in ('{"ok": true}', '{"ok": false}')
    assert client.generate("Pick:", max_new_tokens=8, choice=["yes", "no"]).text in ("yes", "no")


def test_the_deadline_ends_a_long_call(client):
    start = time.monotonic()
    with pytest.raises(moemesh.DeadlineExceededError) as err:
        client.generate("A story without end:", max_new_tokens=4000, ignore_eos=True, timeout=0.5)
    assert time.monotonic() - start < 5
    assert err.value.code.name == "DEADLINE_EXCEEDED"


def test_the_generate_command_prints_the_stream_and_the_usage(client, mesh, capsys):
    expected = client.generate("Hello from the command", max_new_tokens=5, stop=["\n\n\n\n"])
    assert cli.main(["generate", "--target", mesh.gateway_address, "--max-new-tokens", "5",
                     "--stop", "\n\n\n\n", "Hello from the command"]) == 0
    out, err = capsys.readouterr()
    assert out == expected.text
    reason = f"FINISH_REASON_{expected.finish_reason.upper()}"
    assert err.endswith(f"\n[{reason}, prompt {expected.usage.prompt_tokens} tokens, "
                        f"completion {expected.usage.completion_tokens} tokens]\n")
    assert cli.main(["generate", "--target", mesh.gateway_address, "--top-k", "-1", "Hi"]) == 1
    assert "error: INVALID_ARGUMENT: sampling.top_k" in capsys.readouterr().err


def test_the_readme_example_runs(mesh, capsys):
    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    [example] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "moemesh.Client" in block]
    exec(example.replace("127.0.0.1:50051", mesh.gateway_address), {})
    out = capsys.readouterr().out
    assert out.strip().endswith(pathlib.Path(mesh.spec.model_dir).name)


def test_samples_with_logprobs_through_the_mesh(client):
    prompt = "Two samples, scored"
    result = client.generate(prompt, n=2, temperature=1.0, seed=3, max_new_tokens=5, ignore_eos=True,
                             top_logprobs=2, prompt_logprobs=True)
    first, second = result.samples
    assert (first.index, second.index) == (0, 1) and first.token_ids != second.token_ids
    for sample in result.samples:
        assert [lp.token_id for lp in sample.logprobs] == list(sample.token_ids)
        assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in sample.logprobs)
    # The prompt is scored once, by sample 0.
    assert len(first.prompt_logprobs) == len(client.tokenize(prompt)) - 1 and not second.prompt_logprobs
    assert result.usage.completion_tokens == 10
    again = client.generate(prompt, n=2, temperature=1.0, seed=3, max_new_tokens=5, ignore_eos=True)
    assert [s.token_ids for s in again.samples] == [first.token_ids, second.token_ids]
