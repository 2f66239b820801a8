"""LLM programs (moemesh/program/) against the shared running mesh (tests/conftest.py).

select against transformers' log-probabilities on the same checkpoint, chat
roles against the client's own chat request, a DAG's latency against its
branches', forks' cached prefix, and a failing tool aborting the rest.
"""

import asyncio
import gc
import importlib.util
import logging
import pathlib
import time
import urllib.request

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import moemesh
from tests.conftest import hf_logprobs


@pytest.fixture(scope="module")
def runtime(mesh):
    return moemesh.Runtime(mesh.gateway_address, timeout=120)


@pytest.fixture(scope="module")
def client(mesh):
    with moemesh.Client(mesh.gateway_address, timeout=120) as client:
        yield client


def gateway_samples(mesh) -> dict[tuple, float]:
    """The gateway's /metrics samples, by (name, sorted labels)."""
    url = f"http://127.0.0.1:{mesh.gateway.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def num_aborted(mesh) -> float:
    return sum(v for (name, labels), v in gateway_samples(mesh).items()
               if name == "moemesh_requests_total" and ("finish_reason", "abort") in labels)


def num_running(mesh) -> float:
    return gateway_samples(mesh)[("moemesh_num_requests_running", ())]


@moemesh.function
def choose(s, prompt, choices, normalize):
    s += prompt
    s += moemesh.select("pick", choices, normalize=normalize)


@pytest.mark.parametrize(("prompt", "choices"), [
    ("Is the sky blue? Answer:", ["yes", "no"]),
    ("My favourite colour is", [" red", " green", " blue", " purple"]),
    ("On the mat there was", [" the cat", " the cat sat down", " the dog", " a"]),
    ("The capital of France is", [" Paris", " Paris, France", " London", " Lyon"]),
])
@pytest.mark.parametrize("normalize", ["mean", "sum"])
def test_select_picks_the_choice_transformers_ranks_first(runtime, client, hf_model, prompt, choices, normalize):
    state = choose.run(prompt, choices, normalize, runtime=runtime)
    prefix = client.tokenize(prompt)
    reference = {}
    for choice in choices:
        ids = client.tokenize(choice)
        rows = hf_logprobs(hf_model, prefix + ids)
        logprobs = [float(rows[len(prefix) + j - 1, token]) for j, token in enumerate(ids)]
        reference[choice] = sum(logprobs) / (len(logprobs) if normalize == "mean" else 1)
    node = state.node("pick")
    assert node.scores == pytest.approx(reference, abs=1e-3)
    assert state["pick"] == max(choices, key=reference.__getitem__)
    assert state.text() == prompt + state["pick"] and len(node.request_ids) == len(choices)
    assert node.usage.prompt_tokens == sum(len(prefix) + len(client.tokenize(c)) for c in choices)
    assert state.run_nodes() == [node]


BLOCK_SIZE = 16  # the expert services' default KV block


def test_select_prefills_the_shared_prompt_once_and_scores_its_choices_on_it(runtime, client, hf_model):
    """A fresh context: the choices' requests go together and the gateway computes their shared prompt
    once (the others wait for its blocks); a second select on it takes all of the prompt but its last
    token (whose logits score a choice's first) from the cache: the full blocks in place, the rest
    copied from a block the first select's requests left. The scores are transformers' either way."""
    context = "A support ticket about a refund for a double charge on order 48213, from Dana. " * 4
    choices = [" billing", " shipping", " account", " other"]
    prefix = client.tokenize(context)
    assert len(prefix) > 3 * BLOCK_SIZE
    num_choice_tokens = [len(client.tokenize(c)) for c in choices]
    cacheable = (len(prefix) - 1) // BLOCK_SIZE * BLOCK_SIZE
    reference = {}
    for choice in choices:
        ids = client.tokenize(choice)
        rows = hf_logprobs(hf_model, prefix + ids)
        logprobs = [float(rows[len(prefix) + j - 1, token]) for j, token in enumerate(ids)]
        reference[choice] = sum(logprobs) / len(logprobs)
    first = choose.run(context, choices, "mean", runtime=runtime).node("pick")
    second = choose.run(context, choices, "mean", runtime=runtime).node("pick")
    for node in (first, second):
        assert node.scores == pytest.approx(reference, abs=1e-3)
        assert node.value == max(choices, key=reference.__getitem__)
    # Prefilled once: one request computed the shared blocks, the others reused them.
    computed = first.usage.prompt_tokens - first.usage.cached_tokens
    assert first.usage.cached_tokens >= (len(choices) - 1) * cacheable, first.usage
    assert computed <= len(prefix) + sum(num_choice_tokens) + (len(choices) - 1) * BLOCK_SIZE, first.usage
    # Cached: each choice computes the prompt's last token and its own tokens.
    assert second.usage.cached_tokens == len(choices) * (len(prefix) - 1) > len(choices) * cacheable, second.usage


@moemesh.function
def chat(s, question):
    s += moemesh.system("Be brief.")
    s += moemesh.user(question)
    s += moemesh.assistant(moemesh.gen("answer", max_tokens=6, ignore_eos=True))
    s += moemesh.user("And why?")


def test_chat_roles_render_as_the_gateways_chat_template(runtime, client):
    state = chat.run("What is a mesh?", runtime=runtime)
    messages = [("system", "Be brief."), ("user", "What is a mesh?")]
    expected = client.generate(messages=messages, max_new_tokens=6, ignore_eos=True)
    assert state["answer"] == expected.text
    # The prompt with its generation prompt, the answer's own tokens, the closing, the next message.
    prompt_ids = client.tokenize(messages=messages)
    ids = state.token_ids()
    assert ids[:len(prompt_ids) + 6] == prompt_ids + list(expected.token_ids)
    follow_up = client.tokenize(messages=[("user", "And why?")])
    twice = client.tokenize(messages=[("user", "And why?")] * 2)
    num_message = len(twice) - len(follow_up)
    assert 0 < len(follow_up) - num_message < 5
    assert ids[len(ids) - num_message:] == follow_up[:num_message]
    assert state.text() == "Be brief.What is a mesh?" + expected.text + "And why?"


@moemesh.function
def structured(s):
    s += "Reply with a JSON object:"
    s += moemesh.gen("fields", max_tokens=48, json_schema={
        "type": "object", "properties": {"order_id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["order_id", "ok"], "additionalProperties": False})
    s += " Code:"
    s += moemesh.gen("code", max_tokens=8, regex="[A-Z]{3}-[0-9]{2}")
    s += moemesh.bind(lookup, order_id=s.ref("fields")["order_id"], code=s.ref("code"))
    s += moemesh.bind(async_echo, value=s.ref("lookup"))


def lookup(order_id, code):
    return {"order_id": order_id, "code": code, "status": "paid"}


async def async_echo(value):
    await asyncio.sleep(0.01)
    return f"echo {value['status']}"


def test_gen_constraints_and_bound_tools_take_other_nodes_outputs(runtime):
    state = structured.run(runtime=runtime)
    fields = state["fields"]
    assert set(fields) == {"order_id", "ok"} and isinstance(fields["order_id"], int)
    assert len(state["code"]) == 6 and state["code"][3] == "-"
    assert state["lookup"] == {"order_id": fields["order_id"], "code": state["code"], "status": "paid"}
    assert state["async_echo"] == "echo paid"
    assert state.text().endswith('"status": "paid"}echo paid')


def record_call(order_id):
    return {"order_id": order_id, "at": time.monotonic()}


@moemesh.function
def early_field(s):
    s += "Reply with a JSON object:"
    s += moemesh.gen("fields", max_tokens=200, json_schema={
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "story": {"type": "string", "minLength": 80, "maxLength": 90}},
        "required": ["id", "story"], "additionalProperties": False})
    s += moemesh.bind(record_call, order_id=s.ref("fields")["id"])


def test_a_tool_bound_to_a_json_field_starts_while_the_rest_of_the_object_is_generated(runtime):
    early_field.run(runtime=runtime)  # warm: the schema's grammar is compiled once
    start = time.monotonic()
    state = early_field.run(runtime=runtime)
    fields, call = state.node("fields"), state["record_call"]
    assert call["order_id"] == state["fields"]["id"] and len(state["fields"]["story"]) >= 80
    # The gen ended no earlier than start + its seconds; the tool ran in its first half, as soon as "id" was
    # complete (a few tokens of the object), not after the story. A ratio: the demo model's speed varies by machine.
    assert call["at"] - start < 0.5 * fields.seconds, (call["at"] - start, fields.seconds)


def slow_tool(delay):
    time.sleep(delay)
    return "done"


@moemesh.function
def two_gens_and_a_tool(s, max_tokens, delay, forks_out):
    first, second, third = s.fork(3)
    forks_out.extend([first, second, third])
    first += "One story:"
    first += moemesh.gen("a", max_tokens=max_tokens, ignore_eos=True)
    second += "Another story:"
    second += moemesh.gen("b", max_tokens=max_tokens, ignore_eos=True)
    third += moemesh.bind(slow_tool, delay=delay)


@moemesh.function
def one_gen(s, max_tokens):
    s += "One story:"
    s += moemesh.gen("a", max_tokens=max_tokens, ignore_eos=True)


def test_independent_branches_run_concurrently(runtime):
    one_gen.run(8, runtime=runtime)  # warm
    start = time.monotonic()
    one_gen.run(48, runtime=runtime)
    gen_s = time.monotonic() - start
    delay = max(gen_s, 0.5)
    start = time.monotonic()
    forks = []
    two_gens_and_a_tool.run(48, delay, forks, runtime=runtime)
    elapsed = time.monotonic() - start
    assert forks[2]["slow_tool"] == "done" and len(forks[0].node("a").token_ids) == 48
    sequential = 2 * gen_s + delay
    assert delay <= elapsed < 0.7 * sequential, (elapsed, gen_s, delay)
    # The node histogram saw each node once.
    for node, kind in (("a", "gen"), ("b", "gen"), ("slow_tool", "tool")):
        assert REGISTRY.get_sample_value("moemesh_program_node_seconds_count", {
            "program": "two_gens_and_a_tool", "node": node, "kind": kind}) == 1


@moemesh.function
def forked(s, context, forks_out):
    s += context
    forks = s.fork(3)
    for i, fork in enumerate(forks):
        fork += f" Question {i}:"
        fork += moemesh.gen("answer", max_tokens=4, ignore_eos=True)
    s += " Summary:"
    for fork in forks:
        s += fork.ref("answer")
    forks_out.extend(forks)


def test_forks_share_their_prefix_in_the_cache(runtime, client):
    context = "A long shared context about a support ticket, its order and its customer. " * 6
    forks = []
    state = forked.run(context, forks, runtime=runtime)
    num_prefix = len(client.tokenize(context))
    assert num_prefix > 32
    usages = [fork.node("answer").usage for fork in forks]
    for i, usage in enumerate(usages):
        assert usage.prompt_tokens == num_prefix + len(client.tokenize(f" Question {i}:"))
    # The shared prefix was computed once: by one fork's request, the others found it cached.
    usages.sort(key=lambda u: u.cached_tokens)
    assert usages[0].cached_tokens < num_prefix - 16, (usages, num_prefix)
    for usage in usages[1:]:
        assert usage.cached_tokens >= num_prefix, (usages, num_prefix)
    answers = "".join(fork["answer"] for fork in forks)
    assert state.text() == context + " Summary:" + answers


def failing_tool(delay):
    time.sleep(delay)
    raise ConnectionError("payment API unreachable")


@moemesh.function
def fails_midway(s):
    story, tool = s.fork(2)
    story += "A very long story:"
    story += moemesh.gen("story", max_tokens=2000, ignore_eos=True)
    tool += moemesh.bind(failing_tool, delay=1.0)
    story += moemesh.gen("never", max_tokens=4)


def test_a_failing_tool_fails_the_program_and_aborts_the_other_requests(runtime, mesh):
    aborted_before = num_aborted(mesh)
    start = time.monotonic()
    with pytest.raises(moemesh.ProgramError) as err:
        fails_midway.run(runtime=runtime)
    assert time.monotonic() - start < 10
    assert (err.value.node, err.value.kind) == ("failing_tool", "tool")
    assert isinstance(err.value.__cause__, ConnectionError) and "failing_tool" in str(err.value)
    assert err.value.aborted == ("story",)
    # Ended through Abort (finish_reason "abort"), not left running; the gateway counts it as its stream ends.
    deadline = time.monotonic() + 5
    while num_aborted(mesh) < aborted_before + 1 or num_running(mesh):
        assert time.monotonic() < deadline, (num_aborted(mesh) - aborted_before, num_running(mesh))
        time.sleep(0.05)
    assert num_aborted(mesh) == aborted_before + 1


@moemesh.function
def cut_short(s):
    s += "Reply with a JSON object:"
    s += moemesh.gen("fields", max_tokens=3, json_schema={
        "type": "object", "properties": {"note": {"type": "string", "minLength": 20}}, "required": ["note"]})
    s += moemesh.bind(record_call, order_id=s.ref("fields")["note"])


@moemesh.function
def wrong_key(s):
    s += "Say something:"
    s += moemesh.gen("said", max_tokens=2)
    s += moemesh.bind(record_call, order_id=s.ref("said")["id"])


def test_failures_say_what_went_wrong_and_asyncio_reports_nothing(runtime, caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    with pytest.raises(moemesh.ProgramError, match=r"reached max_tokens=3 before its JSON was complete") as err:
        cut_short.run(runtime=runtime)
    assert (err.value.node, err.value.kind) == ("fields", "gen")
    with pytest.raises(moemesh.ProgramError, match=r"a reference's \['id'\]: the value has no such key, "
                                                   r"it is the str") as err:
        wrong_key.run(runtime=runtime)
    assert (err.value.node, err.value.kind) == ("record_call", "tool")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):
        moemesh.gen("x", max_tokens=0)
    # A failed node's future is the run's failure, raised once: none is left "never retrieved".
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_run_batch_keeps_the_order_and_reports_failures(runtime):
    prompts = [f"Item {i}:" for i in range(5)]
    states = choose.run_batch([{"prompt": p, "choices": ["a", "b"], "normalize": "sum"} for p in prompts],
                              runtime=runtime, max_concurrency=3)
    assert [s.text()[:len(p)] for s, p in zip(states, prompts)] == prompts
    results = fails_midway.run_batch([{}], runtime=runtime, return_exceptions=True)
    assert isinstance(results[0], moemesh.ProgramError) and results[0].node == "failing_tool"


def load_example(name: str):
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_run_on_the_mesh(runtime):
    pipeline = load_example("ticket_pipeline")
    states = pipeline.ticket.run_batch([{"text": t, "api_delay": 0.05} for t in pipeline.TICKETS],
                                       runtime=runtime, max_concurrency=3)
    for state in states:
        fields = state["summary"]
        # Schema-valid: exactly the schema's keys, each of its type and within its bounds.
        assert set(fields) == {"category", "order_id", "customer", "urgent"}
        assert fields["category"] in pipeline.CATEGORIES and isinstance(fields["urgent"], bool)
        assert 0 <= fields["order_id"] <= 999999 and len(fields["customer"]) <= 24
        assert state["payment_status"]["order_id"] == fields["order_id"] and isinstance(state["answer"], str)
    votes = load_example("self_consistency").consistent.run("How many?", runtime=runtime)
    assert votes["vote"].isdigit()
    extraction = load_example("parallel_extraction")
    fields = extraction.extract.run(extraction.DOCUMENT, runtime=runtime)["record"]
    assert set(fields) == set(extraction.FIELDS) and fields["payment_method"] in \
        extraction.FIELDS["payment_method"]["choices"]


def current_span_id() -> int:
    return trace.get_current_span().get_span_context().span_id


@moemesh.function
def traced(s):
    s += "Traced:"
    s += moemesh.gen("a", max_tokens=2, ignore_eos=True)
    s += moemesh.bind(current_span_id)


def test_one_span_per_run_with_a_child_per_node(runtime, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    state = traced.run(runtime=runtime)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    run, gen, tool = spans["program traced"], spans["gen a"], spans["tool current_span_id"]
    assert gen.parent.span_id == tool.parent.span_id == run.context.span_id
    assert list(gen.attributes["moemesh.node.request_ids"]) == list(state.node("a").request_ids)
    # The node's span is current where its work runs (a sync tool on the pool; a gen's client call).
    assert state["current_span_id"] == tool.context.span_id


@moemesh.function
def body_fails(s):
    s += "A very long story:"
    s += moemesh.gen("story", max_tokens=2000, ignore_eos=True)
    time.sleep(0.5)
    raise LookupError("the program's own bug")


def test_a_failing_body_aborts_the_nodes_it_started(runtime, mesh):
    aborted_before = num_aborted(mesh)
    with pytest.raises(moemesh.ProgramError) as err:
        body_fails.run(runtime=runtime)
    assert (err.value.node, err.value.kind, err.value.aborted) == ("body_fails", "program", ("story",))
    assert isinstance(err.value.__cause__, LookupError)
    deadline = time.monotonic() + 5
    while num_aborted(mesh) < aborted_before + 1 or num_running(mesh):
        assert time.monotonic() < deadline
        time.sleep(0.05)
