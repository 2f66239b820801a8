"""OpenAI JSON -> GenerateRequest, RequestError fields -> OpenAI parameters, and the response bodies."""

import json
import dataclasses

import pytest

from gateway.http.openai_api import ApiError, parse_chat, parse_completion, param_of, request_error
from gateway.http.responses import ResponseState, chat_logprobs, completion_logprobs
from gateway.requests import FinishReason, RequestOutput
from moe.gateway.v1 import gateway_pb2
from services.step import TokenLogprob


def test_a_completion_becomes_a_generate_request_with_every_parameter():
    api = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                            "seed": 3, "stop": "\n", "n": 2, "logprobs": 2, "stream": True,
                            "stream_options": {"include_usage": True}, "top_k": 4}, "cmpl-1")
    s = api.request.sampling
    assert api.request.request_id == "cmpl-1" and api.request.prompt == "Hi"
    assert (s.max_new_tokens, s.temperature, s.top_k, s.seed, list(s.stop), s.n) == (7, 0.5, 4, 3, ["\n"], 2)
    assert s.top_p == pytest.approx(0.9) and s.logprobs and s.top_logprobs == 2
    assert (api.model, api.n, api.stream, api.include_usage, api.num_top_logprobs) == ("m", 2, True, True, 2)
    assert not api.is_chat and not s.HasField("json_object")


def test_completion_defaults_and_token_prompts():
    api = parse_completion({"prompt": [[5, 6, 7]]}, "c")
    assert list(api.request.input_ids.ids) == [5, 6, 7]
    # OpenAI's default length for completions.
    assert api.request.sampling.max_new_tokens == 16 and not api.request.sampling.HasField("seed")
    assert api.num_top_logprobs is None and not api.stream


def test_a_chat_request_with_response_formats_and_max_completion_tokens():
    api = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3,
                      "response_format": {"type": "json_object"}}, "chatcmpl-1")
    messages = [(m.role, m.content) for m in api.request.messages.messages]
    assert messages == [("system", "be brief"), ("user", "ab")]
    s = api.request.sampling
    assert s.max_new_tokens == 9 and s.json_object and s.logprobs and s.top_logprobs == 3
    assert api.max_tokens_param == "max_completion_tokens" and api.num_top_logprobs == 3 and api.is_chat
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    api = parse_chat({"messages": [{"role": "user", "content": "q"}],
                      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                     "c")
    assert json.loads(api.request.sampling.json_schema) == schema
    # Chat leaves the length to the server's default.
    assert api.request.sampling.max_new_tokens == 0


@pytest.mark.parametrize("parse, body, param", [
    (parse_completion, {"prompt": "a", "temperature": "hot"}, "temperature"),
    (parse_completion, {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    (parse_completion, {"prompt": "a", "n": 0}, "n"),
    (parse_completion, {"prompt": "a", "seed": -5}, "seed"),
    (parse_completion, {"prompt": "a", "stop": [1]}, "stop"),
    (parse_completion, {"prompt": ["a", "b"]}, "prompt"),
    (parse_completion, {"prompt": "a", "echo": True}, "echo"),
    (parse_completion, {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    (parse_completion, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    (parse_completion, {"prompt": "a", "response_format": {"type": "xml"}}, "response_format"),
    (parse_chat, {"messages": "hi"}, "messages"),
    (parse_chat, {"messages": [{"role": "user", "content": 3}]}, "messages"),
    (parse_chat, {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    (parse_chat, {"messages": [{"role": "user", "content": "a"}],
                  "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (parse_chat, {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
    (parse_chat, {"messages": [], "tool_choice": "required"}, "tool_choice"),
    # An explicit 0 (the proto's 0 would mean the server's default length).
    (parse_chat, {"messages": [], "max_tokens": 0}, "max_tokens"),
    (parse_completion, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    # Integers past their proto field's width.
    (parse_chat, {"messages": [], "max_tokens": 2 ** 32}, "max_tokens"),
    (parse_chat, {"messages": [], "max_completion_tokens": 10 ** 12}, "max_completion_tokens"),
    (parse_chat, {"messages": [], "top_k": 2 ** 31}, "top_k"),
    (parse_chat, {"messages": [], "top_k": -2 ** 31 - 1}, "top_k"),
    (parse_chat, {"messages": [], "n": 2 ** 40}, "n"),
    (parse_chat, {"messages": [], "logprobs": True, "top_logprobs": 2 ** 32}, "top_logprobs"),
    (parse_completion, {"prompt": "a", "logprobs": 2 ** 32}, "logprobs"),
    (parse_completion, {"prompt": "a", "seed": 2 ** 64}, "seed"),
    (parse_completion, {"prompt": [1, 2 ** 31]}, "prompt"),
    # Lone UTF-16 surrogates (JSON's "\udc80" escape, decoded by Python, not encodable as UTF-8).
    (parse_chat, {"messages": [{"role": "user", "content": "\udc80"}]}, "messages"),
    (parse_chat, {"messages": [{"role": "\ud800", "content": "a"}]}, "messages"),
    (parse_chat, {"messages": [], "stop": ["ok", "\ud800"]}, "stop"),
    (parse_chat, {"messages": [], "model": "\ud800"}, "model"),
    (parse_chat, {"messages": [], "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "\ud800"}}}}, "response_format"),
    (parse_completion, {"prompt": "a\ud800b"}, "prompt"),
    (parse_completion, {"prompt": "a", "\ud800": 1}, None),
])
def test_json_that_cannot_be_a_request_is_a_400_naming_the_parameter(parse, body, param):
    with pytest.raises(ApiError) as error:
        parse(body, "r")
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body() == {"error": {"message": error.value.message, "type": "invalid_request_error",
                                            "param": param, "code": None}}


def test_errors_name_the_place_of_what_they_refuse():
    with pytest.raises(ApiError, match=r"^prompt\[1\] must be a token id, got 2147483648$"):
        parse_completion({"prompt": [1, 2 ** 31]}, "r")
    with pytest.raises(ApiError, match=r"^messages\[1\]\.content holds a lone UTF-16 surrogate"):
        parse_chat({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "\udc80"}]}, "r")
    with pytest.raises(ApiError, match=r"^max_tokens must be below 2\*\*32, got 4294967296$"):
        parse_chat({"messages": [], "max_tokens": 2 ** 32}, "r")
    # The largest values the fields hold pass on to the Frontend, which checks the limits.
    api = parse_chat({"messages": [], "max_tokens": 2 ** 32 - 1, "top_k": 2 ** 31 - 1, "n": 2 ** 32 - 1}, "r")
    assert (api.request.sampling.max_new_tokens, api.request.sampling.top_k) == (2 ** 32 - 1, 2 ** 31 - 1)


def test_unsupported_parameters_at_their_unused_values_are_accepted():
    api = parse_completion({"prompt": "a", "echo": False, "logit_bias": {}, "presence_penalty": 0,
                            "best_of": 1, "suffix": None, "tool_choice": "none"}, "r")
    assert api.request.prompt == "a"


@pytest.mark.parametrize("field, is_chat, param", [
    ("sampling.temperature", False, "temperature"), ("sampling.top_p", True, "top_p"),
    ("sampling.stop[1]", False, "stop"), ("sampling.seed", False, "seed"), ("sampling.n", True, "n"),
    ("sampling.max_new_tokens", False, "max_tokens"), ("sampling.json_schema", True, "response_format"),
    ("sampling.json_object", False, "response_format"), ("sampling.top_logprobs", False, "logprobs"),
    ("sampling.top_logprobs", True, "top_logprobs"), ("input_ids.ids[2]", False, "prompt"),
    ("prompt", False, "prompt"), ("messages.messages[0].role", True, "messages"),
    ("messages.messages[].content", True, "messages"),
])
def test_request_error_fields_map_to_openai_parameters(field, is_chat, param):
    api = (parse_chat({"messages": [{"role": "user", "content": "a"}]}, "r") if is_chat
           else parse_completion({"prompt": "a"}, "r"))
    assert param_of(field, api) == param


def test_request_error_messages_name_the_parameter_as_the_client_did():
    api = parse_chat({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 5}, "r")
    error = request_error("sampling.max_new_tokens", "sampling.max_new_tokens must be at most 10, got 50", api)
    assert (error.status, error.param, error.message) == (400, "max_completion_tokens",
                                                          "max_completion_tokens must be at most 10, got 50")
    error = request_error("messages.messages[1].role", "messages.messages[1].role must be one of system, user, "
                          "assistant, got 'tool'", api)
    assert error.message.startswith("messages[1].role must be one of") and error.param == "messages"
    error = request_error("sampling.stop[0]", "sampling.stop[0] must not be empty", api)
    assert error.message == "stop[0] must not be empty"


def output(text, ids, *, index=0, final=None, completion_tokens=1):
    return RequestOutput("r", tuple(ids), text, prompt_tokens=4, completion_tokens=completion_tokens,
                         finish_reason=final, cached_tokens=2, index=index)


def test_outputs_are_routed_to_their_choice_by_index_and_usage_counts_the_prompt_once():
    api = parse_completion({"prompt": "a", "n": 2}, "cmpl-9")
    state = ResponseState(api, "cmpl-9", "m", lambda i: b"?")
    for out in [output("ab", [1, 2], completion_tokens=2), output("x", [7], index=1),
                output("c", [3], final=FinishReason.STOP, completion_tokens=3),
                output("yz", [8, 9], index=1, final=FinishReason.LENGTH, completion_tokens=3)]:
        assert state.add(out) == []  # not streaming: no chunks
    body = state.body()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "abc", "stop"), (1, "xyz", "length")]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert body["object"] == "text_completion" and body["id"] == "cmpl-9" and body["model"] == "m"


def test_chat_chunks_carry_the_role_first_then_content_and_the_finish_on_the_last():
    api = parse_chat({"messages": [{"role": "user", "content": "a"}], "stream": True,
                      "stream_options": {"include_usage": True}}, "c")
    state = ResponseState(api, "c", "m", lambda i: b"?")
    chunks = [chunk for out in [output("He", [1]), output("", [2]), output("llo", [3], final=FinishReason.STOP,
                                                                            completion_tokens=3)]
              for chunk in state.add(out)]
    # The middle output added no text (held back): no chunk for it.
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": "He"},
                                                          {"content": "llo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    last = state.usage_chunk()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


TOKENS = {5: b"He", 6: b"llo", 7: b" w", 8: b"\xe2\x82"}
ENTRIES = [(5, -0.1, [(5, -0.1), (7, -2.5)]), (6, -0.2, [(6, -0.2)]), (8, -1.0, [])]


def test_completion_logprobs_map_tokens_logprobs_alternatives_and_text_offsets():
    logprobs = completion_logprobs(ENTRIES, TOKENS.__getitem__, text_offset=10)
    assert logprobs == {"tokens": ["He", "llo", "\ufffd"], "token_logprobs": [-0.1, -0.2, -1.0],
                        "top_logprobs": [{"He": -0.1, " w": -2.5}, {"llo": -0.2}, {}],
                        "text_offset": [10, 12, 15]}


def test_chat_logprobs_give_each_token_its_bytes_and_alternatives():
    logprobs = chat_logprobs(ENTRIES[::2], TOKENS.__getitem__)
    assert logprobs == {"content": [
        {"token": "He", "logprob": -0.1, "bytes": [72, 101],
         "top_logprobs": [{"token": "He", "logprob": -0.1, "bytes": [72, 101]},
                          {"token": " w", "logprob": -2.5, "bytes": [32, 119]}]},
        {"token": "\ufffd", "logprob": -1.0, "bytes": [0xE2, 0x82], "top_logprobs": []}]}


def test_return_token_ids_gives_each_choice_and_chunk_its_tokens():
    api = parse_completion({"prompt": "a", "return_token_ids": True, "stream": True}, "c")
    state = ResponseState(api, "c", "m", TOKENS.__getitem__)
    chunks = [chunk for out in [output("He", [5]), output("", [8]), output("llo", [6], final=FinishReason.STOP)]
              for chunk in state.add(out)]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[5], [8], [6]]
    assert state.body()["choices"][0]["token_ids"] == [5, 8, 6]


def test_outputs_logprobs_become_each_chunks_logprobs():
    api = parse_chat({"messages": [{"role": "user", "content": "a"}], "stream": True, "logprobs": True,
                      "top_logprobs": 1}, "c")
    state = ResponseState(api, "c", "m", TOKENS.__getitem__)

    def with_logprobs(out, entries):
        return dataclasses.replace(out, logprobs=tuple(
            TokenLogprob(token_id=t, logprob=lp, top=tuple(top)) for t, lp, top in entries))

    first = state.add(with_logprobs(output("He", [5]), [(5, -0.1, [(5, -0.1)])]))
    last = state.add(with_logprobs(output("llo", [6], final=FinishReason.STOP), [(6, -0.2, [(6, -0.2)])]))
    assert [c["token"] for c in first[0]["choices"][0]["logprobs"]["content"]] == ["He"]
    assert last[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "llo", "logprob": -0.2, "bytes": list(b"llo")}]
    assert state.choices[0].logprobs == [(5, -0.1, ((5, -0.1),)), (6, -0.2, ((6, -0.2),))]


def test_requests_without_logprobs_get_null_logprobs():
    api = parse_chat({"messages": [{"role": "user", "content": "a"}]}, "c")
    state = ResponseState(api, "c", "m", TOKENS.__getitem__)
    state.add(output("He", [5], final=FinishReason.STOP))
    assert state.body()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body,priority", [({}, gateway_pb2.PRIORITY_INTERACTIVE),
                                           ({"priority": "interactive"}, gateway_pb2.PRIORITY_INTERACTIVE),
                                           ({"priority": "batch"}, gateway_pb2.PRIORITY_BATCH)])
def test_the_priority_field_becomes_the_requests_class(body, priority):
    assert parse_completion({"prompt": "a", **body}, "id").request.priority == priority
    chat = parse_chat({"messages": [{"role": "user", "content": "a"}], **body}, "id")
    assert chat.request.priority == priority
