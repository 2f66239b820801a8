"""validate_request: every rejected field with its name, limit and value in
the message, and the defaults of an accepted request."""

import math

import pytest

from gateway.validation import RequestError, RequestLimits, ValidatedRequest, validate_request
from moe.gateway.v1 import gateway_pb2
from services.constraints import Compiler
from services.step import Constraint, SamplingSpec
from services.tokenizer import Tokenizer

LIMITS = RequestLimits(
    vocab_size=151_936, max_context=64, max_new_tokens_default=16, max_new_tokens_limit=48,
    max_prompt_chars=100, max_stop_strings=2, max_stop_len=5, max_request_id_len=8, max_chat_messages=3,
    max_constraint_chars=200,
)


@pytest.fixture(scope="module")
def tokenizer(cache_dir) -> Tokenizer:
    return Tokenizer.qwen3(cache_dir)


def request(prompt="Hello, world!", **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id="r1", prompt=prompt,
                                       sampling=gateway_pb2.SamplingParams(**sampling))


def chat(*messages) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(messages=gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages]))


def ids_request(ids, **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(input_ids=gateway_pb2.TokenIds(ids=ids),
                                       sampling=gateway_pb2.SamplingParams(**sampling))


def rejected(req, tokenizer, limits=LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_request(req, limits, tokenizer)
    assert isinstance(info.value, ValueError)
    assert info.value.message == str(info.value)
    assert str(info.value).startswith(info.value.field)
    return info.value


def test_prompt_request_with_defaults(tokenizer):
    v = validate_request(request(), LIMITS, tokenizer)
    assert v == ValidatedRequest(
        request_id="r1", prompt_ids=[9707, 11, 1879, 0], max_new_tokens=16,
        sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=v.sampling.seed), stops=(), ignore_eos=False)
    assert 0 <= v.sampling.seed < 2**63


def test_random_seeds_differ_and_explicit_seed_is_kept(tokenizer):
    assert len({validate_request(request(), LIMITS, tokenizer).sampling.seed for _ in range(4)}) == 4
    assert validate_request(request(seed=2**64 - 1), LIMITS, tokenizer).sampling.seed == 2**64 - 1
    assert validate_request(request(seed=0), LIMITS, tokenizer).sampling.seed == 0


def test_sampling_values_are_kept(tokenizer):
    v = validate_request(request(max_new_tokens=48, temperature=0.7, top_p=0.9, top_k=151_936,
                                 stop=["\n\n", "END"], ignore_eos=True), LIMITS, tokenizer)
    assert (v.max_new_tokens, v.sampling.temperature, v.sampling.top_p, v.sampling.top_k) == (48, 0.7, 0.9, 151_936)
    assert v.stops == ("\n\n", "END") and v.ignore_eos


def test_unset_sampling_is_greedy_with_default_length(tokenizer):
    req = gateway_pb2.GenerateRequest(request_id="r", prompt="hi")
    v = validate_request(req, LIMITS, tokenizer)
    assert (v.sampling.temperature, v.sampling.top_p, v.sampling.top_k, v.max_new_tokens) == (0.0, 1.0, 0, 16)


def test_empty_request_id_gets_one(tokenizer):
    req = request()
    req.request_id = ""
    ids = {validate_request(req, LIMITS, tokenizer).request_id for _ in range(2)}
    assert len(ids) == 2 and all(ids)


def test_input_ids_are_used_as_they_are(tokenizer):
    assert validate_request(ids_request([0, 151_935, 151_645]), LIMITS, tokenizer).prompt_ids == [
        0, 151_935, 151_645]


def test_chat_messages_use_the_template(tokenizer):
    messages = [("system", "Be brief."), ("user", "Hi <|im_end|>")]
    v = validate_request(chat(*messages), LIMITS, tokenizer)
    assert v.prompt_ids == tokenizer.encode_chat(messages)


@pytest.mark.parametrize("temperature", [-0.5, 2.5, 7.5, math.nan, math.inf, -math.inf])
def test_temperature_out_of_range(tokenizer, temperature):
    e = rejected(request(temperature=temperature), tokenizer)
    assert e.field == "sampling.temperature"
    assert str(e) == f"sampling.temperature must be in [0, 2], got {temperature!r}"


def test_temperature_limits_are_inclusive(tokenizer):
    assert validate_request(request(temperature=2.0), LIMITS, tokenizer).sampling.temperature == 2.0


@pytest.mark.parametrize("top_p", [-0.1, 1.5, math.nan])
def test_top_p_out_of_range(tokenizer, top_p):
    e = rejected(request(top_p=top_p), tokenizer)
    assert e.field == "sampling.top_p"
    assert str(e) == f"sampling.top_p must be in (0, 1], got {top_p!r}"


@pytest.mark.parametrize("top_k", [-1, 151_937])
def test_top_k_out_of_range(tokenizer, top_k):
    e = rejected(request(top_k=top_k), tokenizer)
    assert (e.field, str(e)) == ("sampling.top_k", f"sampling.top_k must be in [0, 151936], got {top_k}")


def test_max_new_tokens_over_the_limit(tokenizer):
    e = rejected(request(max_new_tokens=49), tokenizer)
    assert e.field == "sampling.max_new_tokens"
    assert str(e) == "sampling.max_new_tokens must be at most 48, got 49"


def test_prompt_and_max_new_tokens_over_the_context(tokenizer):
    prompt = "7" * 30                        # a token per digit
    assert len(tokenizer.encode(prompt)) == 30
    assert validate_request(request(prompt, max_new_tokens=34), LIMITS, tokenizer).max_new_tokens == 34
    e = rejected(request(prompt, max_new_tokens=35), tokenizer)
    assert e.field == "sampling.max_new_tokens"
    assert "prompt_tokens 30 + max_new_tokens 35 = 65 exceeds the context length 64" in str(e)


def test_default_length_is_cut_to_the_room_left(tokenizer):
    v = validate_request(request("7" * 60), LIMITS, tokenizer)     # 60 tokens, 4 left
    assert v.max_new_tokens == 4


@pytest.mark.parametrize("num_tokens", [64, 70])
def test_prompt_filling_the_context(tokenizer, num_tokens):
    e = rejected(ids_request([1] * num_tokens), tokenizer)
    assert e.field == "input_ids.ids"
    assert str(e) == (f"input_ids.ids has {num_tokens} tokens, which leaves no room to generate "
                      "within the context length 64")


def test_missing_input(tokenizer):
    e = rejected(gateway_pb2.GenerateRequest(request_id="r"), tokenizer)
    assert (e.field, str(e)) == ("input", "input must be set to one of prompt, input_ids, messages")


def test_empty_prompt(tokenizer):
    e = rejected(request(""), tokenizer)
    assert (e.field, str(e)) == ("prompt", "prompt must not be empty")


def test_prompt_too_long(tokenizer):
    e = rejected(request("x" * 101), tokenizer)
    assert (e.field, str(e)) == ("prompt", "prompt must be at most 100 characters, got 101")


def test_empty_input_ids(tokenizer):
    e = rejected(ids_request([]), tokenizer)
    assert (e.field, str(e)) == ("input_ids.ids", "input_ids.ids must not be empty")


@pytest.mark.parametrize("bad_id", [-1, 151_936, 2**31 - 1])
def test_token_id_out_of_range(tokenizer, bad_id):
    e = rejected(ids_request([5, 6, bad_id]), tokenizer)
    assert (e.field, str(e)) == ("input_ids.ids[2]", f"input_ids.ids[2] must be in [0, 151936), got {bad_id}")


def test_empty_chat(tokenizer):
    e = rejected(chat(), tokenizer)
    assert (e.field, str(e)) == ("messages.messages", "messages.messages must not be empty")


def test_too_many_chat_messages(tokenizer):
    e = rejected(chat(*[("user", "hi")] * 4), tokenizer)
    assert (e.field, str(e)) == ("messages.messages", "messages.messages must have at most 3 messages, got 4")


@pytest.mark.parametrize("role", ["tool", "User", ""])
def test_unknown_chat_role(tokenizer, role):
    e = rejected(chat(("system", "s"), (role, "x")), tokenizer)
    assert e.field == "messages.messages[1].role"
    assert str(e) == f"messages.messages[1].role must be one of system, user, assistant, got {role!r}"


def test_chat_contents_too_long(tokenizer):
    e = rejected(chat(("system", "x" * 60), ("user", "y" * 41)), tokenizer)
    assert e.field == "messages.messages[].content"
    assert str(e) == "messages.messages[].content must be at most 100 characters in all, got 101"


def test_too_many_stop_strings(tokenizer):
    e = rejected(request(stop=["a", "b", "c"]), tokenizer)
    assert (e.field, str(e)) == ("sampling.stop", "sampling.stop must have at most 2 strings, got 3")


def test_empty_stop_string(tokenizer):
    e = rejected(request(stop=["a", ""]), tokenizer)
    assert (e.field, str(e)) == ("sampling.stop[1]", "sampling.stop[1] must not be empty")


def test_stop_string_too_long(tokenizer):
    e = rejected(request(stop=["123456"]), tokenizer)
    assert (e.field, str(e)) == ("sampling.stop[0]", "sampling.stop[0] must be at most 5 characters, got 6")


def test_request_id_too_long(tokenizer):
    req = request()
    req.request_id = "r" * 9
    e = rejected(req, tokenizer)
    assert (e.field, str(e)) == ("request_id", "request_id must be at most 8 characters, got 9")


def test_cheap_checks_run_before_tokenization():
    class NoTokenizer:
        def encode(self, text):
            raise AssertionError("tokenized")

        encode_chat = encode

    with pytest.raises(RequestError, match="sampling.temperature"):
        validate_request(request("x" * 100, temperature=3.0), LIMITS, NoTokenizer())
    with pytest.raises(RequestError, match="prompt must be at most"):
        validate_request(request("x" * 101), LIMITS, NoTokenizer())


@pytest.mark.parametrize("field, value", [("vocab_size", 0), ("max_context", -1), ("max_stop_len", 1.5)])
def test_limits_are_checked(field, value):
    with pytest.raises(ValueError, match=f"RequestLimits.{field} must be a positive int, got {value!r}"):
        RequestLimits(**{"vocab_size": 10, "max_context": 10, field: value})


def test_default_length_over_the_limit_is_rejected():
    message = r"max_new_tokens_default \(100\) must be at most max_new_tokens_limit \(50\)"
    with pytest.raises(ValueError, match=message):
        RequestLimits(vocab_size=10, max_context=10, max_new_tokens_default=100, max_new_tokens_limit=50)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
    """The gateway's Compiler: the tokenizer's, over the model's logits width."""
    return Compiler.for_tokenizer(tokenizer, LIMITS.vocab_size)


def constrained(**constraint) -> gateway_pb2.GenerateRequest:
    return request(max_new_tokens=8, **constraint)


@pytest.mark.parametrize("constraint, field, reason", [
    ({"json_schema": "{"}, "sampling.json_schema", "is not valid JSON"),
    ({"json_schema": "[1]"}, "sampling.json_schema", "must be a JSON object, got list"),
    ({"json_schema": '{"type": "objec"}'}, "sampling.json_schema", "objec"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "sampling.json_schema", "uniqueItems"),
    ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "sampling.json_schema", "/$defs/missing"),
    ({"json_schema": '{"type": "string", "pattern": "a("}'}, "sampling.json_schema", "a("),
    ({"json_schema": '{"x-guidance": {"whitespace_flexible": true}}'}, "sampling.json_schema", "x-guidance"),
    ({"json_object": False}, "sampling.json_object", "must be true"),
    ({"regex": "[a-z"}, "sampling.regex", "unclosed character class"),
    ({"grammar": " \n"}, "sampling.grammar", "is empty"),
    ({"grammar": "start: undefined_rule"}, "sampling.grammar", "undefined_rule"),
    ({"choice": gateway_pb2.Choice()}, "sampling.choice", "at least one option"),
    ({"choice": gateway_pb2.Choice(options=["yes", ""])}, "sampling.choice", "option 2 is empty"),
])
def test_a_constraint_that_does_not_compile_names_its_field(tokenizer, compiler, constraint, field, reason):
    with pytest.raises(RequestError) as info:
        validate_request(constrained(**constraint), LIMITS, tokenizer, compiler)
    assert info.value.field == field
    assert str(info.value).startswith(field + " ") and reason in str(info.value), str(info.value)


@pytest.mark.parametrize("constraint, field", [
    ({"regex": "a" * 201}, "sampling.regex"),
    ({"json_schema": " " * 201}, "sampling.json_schema"),
    ({"grammar": " " * 201}, "sampling.grammar"),
    ({"choice": gateway_pb2.Choice(options=["a" * 100, "b" * 101])}, "sampling.choice"),
])
def test_a_constraint_over_the_size_limit_is_refused_before_it_is_compiled(tokenizer, constraint, field):
    class NoCompiler:
        def compile(self, constraint):
            raise AssertionError("compiled")

    with pytest.raises(RequestError) as info:
        validate_request(constrained(**constraint), LIMITS, tokenizer, NoCompiler())
    assert (info.value.field, str(info.value)) == (field, f"{field} must be at most 200 characters, got 201")


def test_ignore_eos_with_a_constraint_is_refused(tokenizer, compiler):
    with pytest.raises(RequestError) as info:
        validate_request(constrained(regex="[0-9]+", ignore_eos=True), LIMITS, tokenizer, compiler)
    assert info.value.field == "sampling.ignore_eos"
    assert str(info.value) == ("sampling.ignore_eos must be false with a constraint (sampling.regex): "
                               "a constrained output ends with an end-of-sequence token")
    assert validate_request(request(ignore_eos=True), LIMITS, tokenizer, compiler).ignore_eos


def test_a_server_without_a_compiler_refuses_constraints(tokenizer):
    with pytest.raises(RequestError) as info:
        validate_request(constrained(json_object=True), LIMITS, tokenizer)
    assert info.value.field == "sampling.json_object" and "not supported" in str(info.value)


@pytest.mark.parametrize("constraint, expected", [
    ({"json_schema": '{"type": "object", "properties": {"a": {"enum": [1, 2]}}}'},
     Constraint("json_schema", '{"type": "object", "properties": {"a": {"enum": [1, 2]}}}')),
    ({"json_object": True}, Constraint("json_object")),
    ({"regex": "[0-9]{3}"}, Constraint("regex", "[0-9]{3}")),
    ({"grammar": 'start: "a" | "b"'}, Constraint("grammar", 'start: "a" | "b"')),
    ({"choice": gateway_pb2.Choice(options=["yes", "no"])}, Constraint("choice", ("yes", "no"))),
])
def test_a_valid_constraint_reaches_the_validated_request(tokenizer, compiler, constraint, expected):
    v = validate_request(constrained(**constraint), LIMITS, tokenizer, compiler)
    assert v.constraint == expected
    assert (v.prompt_ids, v.max_new_tokens, v.ignore_eos) == ([9707, 11, 1879, 0], 8, False)
    assert validate_request(request(), LIMITS, tokenizer, compiler).constraint is None


def test_equal_constraints_are_compiled_once(tokenizer, compiler, monkeypatch):
    builds = []
    build = compiler._build
    monkeypatch.setattr(compiler, "_build", lambda c: builds.append(c) or build(c))
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    first, second = (validate_request(constrained(json_schema=schema), LIMITS, tokenizer, compiler)
                     for _ in range(2))
    assert first.constraint == second.constraint == Constraint("json_schema", schema)
    assert builds == [first.constraint]
    assert compiler.compile(second.constraint).constraint == first.constraint and len(builds) == 1


@pytest.mark.parametrize("n, expected", [(0, 1), (1, 1), (2, 2), (16, 16)])
def test_n_samples_in_range_are_kept_and_0_means_1(tokenizer, n, expected):
    assert validate_request(request(n=n, temperature=0.8), LIMITS, tokenizer).n == expected


@pytest.mark.parametrize("n", [17, 2**32 - 1])
def test_more_than_16_samples_are_refused(tokenizer, n):
    error = rejected(request(n=n, temperature=0.8), tokenizer)
    assert error.field == "sampling.n" and "[1, 16]" in error.message and f"got {n}" in error.message


def test_several_greedy_samples_are_refused_and_one_is_not(tokenizer):
    error = rejected(request(n=2), tokenizer)
    assert error.field == "sampling.n" and "greedy" in error.message and "got 2" in error.message
    assert validate_request(request(n=1), LIMITS, tokenizer).n == 1
