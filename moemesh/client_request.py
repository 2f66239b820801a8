"""The Python client's requests: keyword arguments into GenerateRequest and TokenizeRequest.

The keyword arguments of `Client.generate`/`stream` mirror SamplingParams'
fields (`SamplingOptions`); a json_schema may be a dict (sent as JSON). Misuse
that the proto could not even express (two inputs, two constraints, a value no
field can hold) raises ValueError or TypeError here, naming the argument;
everything else is the gateway's to check, so that the rules
live in one place and its INVALID_ARGUMENT names the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TypedDict

from moe.gateway.v1 import gateway_pb2

# A chat turn: {"role": ..., "content": ...} or (role, content).
Message = Mapping[str, str] | tuple[str, str]


class SamplingOptions(TypedDict, total=False):
    """The keyword arguments of generate/stream, as SamplingParams names them (its comments say what each does)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: str | Sequence[str]
    ignore_eos: bool
    json_schema: str | Mapping
    json_object: bool
    regex: str
    grammar: str
    choice: Sequence[str]
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    prompt_logprobs_start: int
    n: int
    # Not a SamplingParams field: GenerateRequest.priority, "interactive" (default) or "batch".
    priority: str


CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar", "choice")


def sampling_params(*, max_new_tokens: int = 0, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                    seed: int | None = None, stop: str | Sequence[str] = (), ignore_eos: bool = False,
                    json_schema: str | Mapping | None = None, json_object: bool = False, regex: str | None = None,
                    grammar: str | None = None, choice: Sequence[str] | None = None, logprobs: bool = False,
                    top_logprobs: int = 0, prompt_logprobs: bool = False, prompt_logprobs_start: int = 0,
                    n: int = 0) -> gateway_pb2.SamplingParams:
    """SamplingParams of the keyword arguments; TypeError for an unknown one, ValueError for two constraints."""
    given = {"json_schema": json_schema is not None, "json_object": json_object, "regex": regex is not None,
             "grammar": grammar is not None, "choice": choice is not None}
    constraints = [name for name in CONSTRAINTS if given[name]]
    if len(constraints) > 1:
        raise ValueError(f"at most one constraint may be given, got {', '.join(constraints)}")
    sampling = gateway_pb2.SamplingParams()
    fields = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                  ignore_eos=ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
                  prompt_logprobs=prompt_logprobs, prompt_logprobs_start=prompt_logprobs_start, n=n, seed=seed)
    if json_schema is not None:
        fields["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        fields["json_object"] = True
    elif regex is not None:
        fields["regex"] = regex
    elif grammar is not None:
        fields["grammar"] = grammar
    for name, value in fields.items():
        if value is not None:
            _fill(name, setattr, sampling, name, value)
    _fill("stop", sampling.stop.extend, [stop] if isinstance(stop, str) else stop)
    if choice is not None:
        if isinstance(choice, str):
            raise ValueError(f"choice must be a sequence of texts, not the string {choice!r}")
        # An empty list still sets the constraint, so the gateway refuses it by name.
        sampling.choice.SetInParent()
        _fill("choice", sampling.choice.options.extend, choice)
    return sampling


def _fill(name: str, setter, *args, **kwargs) -> None:
    """setter(*args, **kwargs), with what the proto refuses (a negative or too wide integer, a string UTF-8
    cannot encode, a wrong type) raised naming the keyword argument."""
    try:
        setter(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{name}: {error}") from error
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error


def chat_messages(messages: Iterable[Message]) -> gateway_pb2.ChatMessages:
    """ChatMessages of dicts with "role" and "content", or of (role, content) pairs."""
    result = gateway_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            role, content = message["role"], message["content"]
        elif isinstance(message, Sequence) and not isinstance(message, str) and len(message) == 2:
            role, content = message
        else:
            raise ValueError(f"messages[{i}] must be a dict with role and content or a (role, content) pair, "
                             f"got {message!r}")
        _fill(f"messages[{i}]", result.messages.add, role=role, content=content)
    return result


_PRIORITIES = {"interactive": gateway_pb2.PRIORITY_INTERACTIVE, "batch": gateway_pb2.PRIORITY_BATCH}


def generate_request(prompt: str | None = None, *, messages: Iterable[Message] | None = None,
                     input_ids: Sequence[int] | None = None, request_id: str = "", priority: str = "interactive",
                     **options) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest of exactly one input (prompt, messages or input_ids) and SamplingOptions;
    priority "interactive" or "batch" (the gateway admits interactive requests first)."""
    if priority not in _PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(_PRIORITIES)}, got {priority!r}")
    inputs = [name for name, value in (("prompt", prompt), ("messages", messages), ("input_ids", input_ids))
              if value is not None]
    if len(inputs) != 1:
        raise ValueError(f"exactly one of prompt, messages, input_ids must be given, got {inputs or 'none'}")
    request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling_params(**options),
                                          priority=_PRIORITIES[priority])
    if prompt is not None:
        _fill("prompt", setattr, request, "prompt", prompt)
    elif messages is not None:
        request.messages.CopyFrom(chat_messages(messages))
    else:
        _fill("input_ids", request.input_ids.ids.extend, input_ids)
    return request


def tokenize_request(text: str | None = None, *,
                     messages: Iterable[Message] | None = None) -> gateway_pb2.TokenizeRequest:
    """The TokenizeRequest of exactly one of text and messages."""
    if (text is None) == (messages is None):
        raise ValueError("exactly one of text, messages must be given")
    if text is not None:
        request = gateway_pb2.TokenizeRequest()
        _fill("text", setattr, request, "text", text)
        return request
    return gateway_pb2.TokenizeRequest(messages=chat_messages(messages))
