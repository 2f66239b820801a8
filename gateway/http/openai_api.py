"""OpenAI's request JSON -> a moe.gateway.v1 GenerateRequest, and errors in OpenAI's shape.

`parse_completion` and `parse_chat` turn the body of POST /v1/completions and
/v1/chat/completions into an `ApiRequest` holding a GenerateRequest, which the
gateway's Frontend validates like any gRPC request: only JSON types are
checked here (a string where a number belongs cannot become a proto field),
and what no proto field can hold: an integer past its field's width, a string
with a lone UTF-16 surrogate (JSON's "\\ud800" escape, which Python decodes but
UTF-8 cannot encode). Ranges and limits are the Frontend's, and `param_of`
maps the field its RequestError names (sampling.temperature) back to the OpenAI parameter
(temperature). A parameter this server cannot honour (echo, logit_bias,
penalties, tools) is refused, not ignored.

The bodies of the responses are responses.py's.
"""

import dataclasses
import json
import math
import re

from moe.gateway.v1 import gateway_pb2

# Parameters of OpenAI's API this server does not implement, with the value that means "not used".
_UNSUPPORTED = {"echo": (False, None), "suffix": (None, ""), "logit_bias": (None, {}),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "tools": (None, []), "functions": (None, []), "best_of": (None, 1),
                # Without tools a call cannot be forced; "none" and "auto" ask for none.
                "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto")}
_CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn


class ApiError(Exception):
    """A request refused before or by the Frontend, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        # Response headers beside the body (Retry-After of a request refused under load).
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True, slots=True)
class ApiRequest:
    """One OpenAI request, translated."""

    is_chat: bool
    request: gateway_pb2.GenerateRequest
    model: str
    n: int
    stream: bool
    include_usage: bool
    # Log-probabilities asked for: None (none), else the alternatives per position.
    num_top_logprobs: int | None
    # vLLM's return_token_ids: each choice (and chunk) also carries its token ids.
    return_token_ids: bool = False
    # The name the client gave the length limit: errors about it use that name.
    max_tokens_param: str = "max_tokens"


def _bad(param: str, detail: str) -> ApiError:
    """A 400 naming `param`; a detail starting with an index ("[2] must ...") continues its path."""
    return ApiError(400, f"{param}{'' if detail.startswith('[') else ' '}{detail}", param=param)


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _bad(name, f"must be {what}, got {json.dumps(value)[:80]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(name, f"must be {what}, got {value}")
    return value


def _non_negative(body: dict, name: str, bits: int = 32) -> int | None:
    """An unsigned integer parameter whose proto field has `bits` bits."""
    value = _get(body, name, (int,), "a non-negative integer")
    if value is not None and value < 0:
        raise _bad(name, f"must be a non-negative integer, got {value}")
    if value is not None and value >= 2 ** bits:
        raise _bad(name, f"must be below 2**{bits}, got {value}")
    return value


def _max_tokens(body: dict, name: str) -> int | None:
    """The length limit; an explicit 0 is refused (the proto's 0 would mean the server's default)."""
    value = _non_negative(body, name)
    if value == 0:
        raise _bad(name, "must be at least 1, got 0")
    return value


def _encodes(text: str) -> bool:
    """Whether UTF-8 can encode text (not if it holds a lone UTF-16 surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(body) -> str | None:
    """The JSON path ("" for the body) of the first string in `body` that UTF-8 cannot encode; a
    key that cannot be encoded names the object holding it. Iterative: any depth json.loads reads."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path
        elif isinstance(value, dict):
            if not _encodes("".join(value)):
                return path
            stack.extend(reversed([(item, f"{path}.{key}" if path else key) for key, item in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(value)]))
    return None


def _common(body: dict, sampling: gateway_pb2.SamplingParams) -> dict:
    """The sampling parameters both endpoints share; returns the request's framing flags."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    where = _lone_surrogate(body)
    if where is not None:
        param = re.split(r"[.\[]", where, maxsplit=1)[0] or None
        raise ApiError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                            "without its pair), which is not text", param=param)
    for name, unused in _UNSUPPORTED.items():
        if name in body and body[name] not in unused:
            raise _bad(name, "is not supported by this server")
    for name in ("temperature", "top_p"):
        value = _get(body, name, (int, float), "a number")
        if value is not None:
            setattr(sampling, name, value)
    top_k = _get(body, "top_k", (int,), "an integer", 0)  # vLLM's extension
    if not -2 ** 31 <= top_k < 2 ** 31:
        raise _bad("top_k", f"must be a 32-bit integer, got {top_k}")
    sampling.top_k = top_k
    sampling.ignore_eos = _get(body, "ignore_eos", (bool,), "a boolean", False)
    seed = _non_negative(body, "seed", bits=64)
    if seed is not None:
        sampling.seed = seed
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("stop", "must be a string or a list of strings")
    sampling.stop.extend(stops or ())
    n = _non_negative(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise _bad("n", f"must be a positive integer, got {n}")
    sampling.n = n
    _response_format(body.get("response_format"), sampling)
    stream = _get(body, "stream", (bool,), "a boolean", False)
    options = _get(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    include_usage = _get(options, "include_usage", (bool,), "a boolean", False) if options else False
    model = _get(body, "model", (str,), "a string", "")
    return {"model": model, "n": n, "stream": stream, "include_usage": include_usage,
            "return_token_ids": _get(body, "return_token_ids", (bool,), "a boolean", False)}


_PRIORITIES = {"interactive": gateway_pb2.PRIORITY_INTERACTIVE, "batch": gateway_pb2.PRIORITY_BATCH}


def _priority(body: dict) -> int:
    """The body's `priority` ("interactive", the default, or "batch") as the proto's enum."""
    value = _get(body, "priority", (str,), 'one of "interactive", "batch"', "interactive")
    if value not in _PRIORITIES:
        raise _bad("priority", f'must be one of "interactive", "batch", got {json.dumps(value)[:80]}')
    return _PRIORITIES[value]


def _response_format(value, sampling: gateway_pb2.SamplingParams) -> None:
    """response_format -> the proto's json_object or json_schema constraint."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        sampling.json_object = True
    elif kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format", "of type json_schema must have json_schema.schema, a JSON object")
        sampling.json_schema = json.dumps(schema)
    elif kind != "text":
        raise _bad("response_format", "must have type text, json_object or json_schema")


def parse_completion(body: dict, request_id: str) -> ApiRequest:
    """The body of POST /v1/completions; raises ApiError."""
    sampling = gateway_pb2.SamplingParams()
    flags = _common(body, sampling)
    max_tokens = _max_tokens(body, "max_tokens")
    sampling.max_new_tokens = 16 if max_tokens is None else max_tokens  # OpenAI's default for completions
    num_top = _non_negative(body, "logprobs")
    if num_top is not None:
        sampling.logprobs, sampling.top_logprobs = True, num_top
    request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling, priority=_priority(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # Ids past int32 cannot reach the Frontend's check against the vocabulary.
        wide = next((i for i, t in enumerate(prompt) if not -2 ** 31 <= t < 2 ** 31), None)
        if wide is not None:
            raise _bad("prompt", f"[{wide}] must be a token id, got {prompt[wide]}")
        request.input_ids.ids.extend(prompt)
    else:
        raise _bad("prompt", "must be a string or a list of token ids (one prompt per request)")
    return ApiRequest(is_chat=False, request=request, num_top_logprobs=num_top, **flags)


def parse_chat(body: dict, request_id: str) -> ApiRequest:
    """The body of POST /v1/chat/completions; raises ApiError."""
    sampling = gateway_pb2.SamplingParams()
    flags = _common(body, sampling)
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling.max_new_tokens = _max_tokens(body, param) or 0  # 0: the server's default
    is_logprobs = _get(body, "logprobs", (bool,), "a boolean", False)
    num_top = _non_negative(body, "top_logprobs")
    if num_top is not None and not is_logprobs:
        raise _bad("top_logprobs", "requires logprobs: true")
    if is_logprobs:
        sampling.logprobs, sampling.top_logprobs = True, num_top or 0
    request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling, priority=_priority(body))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "must be a list of messages")
    request.messages.SetInParent()  # chat input, even with no message (the Frontend refuses that, naming it)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad("messages", f"[{i}] must be an object with a role")
        role = _CHAT_ROLES.get(message["role"], message["role"])
        request.messages.messages.add(role=role, content=_content(message.get("content"), i))
    return ApiRequest(is_chat=True, request=request, num_top_logprobs=num_top if is_logprobs else None,
                      max_tokens_param=param, **flags)


def _content(content, i: int) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad("messages", f"[{i}].content must be a string or a list of text parts")


def _proto_path(field: str) -> str:
    """A RequestError's field as the client's JSON spells the path, before renaming its base."""
    return field.removeprefix("sampling.").replace("messages.messages", "messages").replace("input_ids.ids", "prompt")


def param_of(field: str, api: ApiRequest) -> str:
    """The OpenAI parameter of a RequestError's field (sampling.stop[1] -> stop)."""
    base = re.split(r"[.\[]", _proto_path(field), maxsplit=1)[0]
    renamed = {"max_new_tokens": api.max_tokens_param, "json_schema": "response_format",
               "json_object": "response_format", "input": "messages" if api.is_chat else "prompt",
               "top_logprobs": "top_logprobs" if api.is_chat else "logprobs"}
    return renamed.get(base, base)


def request_error(field: str, message: str, api: ApiRequest) -> ApiError:
    """The 400 of a RequestError: its message with the field named as the client named it."""
    param = param_of(field, api)
    if message.startswith(field):
        path = _proto_path(field)
        base = re.split(r"[.\[]", path, maxsplit=1)[0]
        message = param + path[len(base):] + message[len(field):]
    return ApiError(400, message, param=param)
