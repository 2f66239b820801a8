"""Checking a GenerateRequest against the server's limits, before it is queued.

`validate_request` turns a `gateway_pb2.GenerateRequest` into a
`ValidatedRequest` (the prompt tokenized, defaults applied) or raises
`RequestError`, whose message names the field, the limit and the bad value;
the servicer maps it to INVALID_ARGUMENT. Cheap checks run before the prompt
is tokenized, so an oversized request costs no tokenization. Inputs of
LARGE_INPUT_SIZE or more are validated in a thread by the servicer, with a
GilFreeTokenizer, so that other streams keep flowing meanwhile.

A request's constraint (SamplingParams' oneof constraint) becomes a
services.constraints.Constraint, compiled here with the gateway's Compiler (one
per gateway, cached by content), so that one that cannot be compiled is refused
before any model work; the compiled form is the Compiler's, and the Constraint
travels on in the ValidatedRequest to admission's NewSequence and the rank.
The servicer validates constrained requests in a thread too: a cold compile
takes milliseconds (llguidance releases the GIL meanwhile).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import struct
import uuid
from collections.abc import Sequence
from typing import NoReturn, Protocol

from moe.gateway.v1 import gateway_pb2
from services.constraints import Compiler
from services.step import NO_LOGPROBS, Constraint, ConstraintError, LogprobSpec, SamplingSpec, SpecError
from services.tokenizer import CHAT_ROLES, Tokenizer

# Inputs at least this long (characters, or token ids) are validated off the
# event loop (the servicer runs validate_request in a thread): tokenizing a
# 1M-character prompt takes seconds.
LARGE_INPUT_SIZE = 16_384
# The most samples (SamplingParams.n) one request may ask for.
MAX_SAMPLES = 16


class PromptTokenizer(Protocol):
    """What validation needs of a tokenizer (services.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...


class GilFreeTokenizer(Tokenizer):
    """The gateway's tokenizer: encodes a long text through the Rust backend's
    encode_batch, which releases the GIL while it works (encode holds it for
    the whole text), so the event loop keeps streaming while a thread
    tokenizes a huge prompt. Same ids as Tokenizer.encode."""

    def encode(self, text: str) -> list[int]:
        if len(text) < LARGE_INPUT_SIZE:
            return Tokenizer.encode(self, text)
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids


def input_size(req: gateway_pb2.GenerateRequest) -> int:
    """How big the request's input is: characters of text, or token ids."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        return len(req.prompt)
    if kind == "input_ids":
        return len(req.input_ids.ids)
    if kind == "messages":
        return sum(len(m.content) for m in req.messages.messages)
    return 0


class RequestError(ValueError):
    """A request breaks a limit; `message` names `field`, the limit and the value."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server's limits on one request."""

    # Token ids must be below it; top_k at most it (the model's vocab_size).
    vocab_size: int
    # prompt + generated tokens (the model's max_position_embeddings).
    max_context: int
    # max_new_tokens when the request leaves it 0, cut to the room left in the context.
    max_new_tokens_default: int = 256
    # The most max_new_tokens a request may ask for.
    max_new_tokens_limit: int = 32_768
    # Characters of the prompt, or of all chat contents together.
    max_prompt_chars: int = 1_000_000
    max_stop_strings: int = 16
    # Characters of one stop string.
    max_stop_len: int = 256
    # Characters of the request id.
    max_request_id_len: int = 256
    max_chat_messages: int = 1024
    # Characters of a constraint (a schema, regex or grammar; a choice's options together):
    # compiling one costs time and memory with its size.
    max_constraint_chars: int = 100_000

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RequestLimits.{field.name} must be a positive int, got {value!r}")
        if self.max_new_tokens_default > self.max_new_tokens_limit:
            raise ValueError(
                f"RequestLimits.max_new_tokens_default ({self.max_new_tokens_default}) must be at most "
                f"max_new_tokens_limit ({self.max_new_tokens_limit})")


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A request that fits the limits, with its defaults applied."""

    # The client's id, or a generated one if it sent none.
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    # The step contract's sampling (services/step.py); the seed is the client's or a random 63-bit one.
    sampling: SamplingSpec
    stops: tuple[str, ...]
    ignore_eos: bool
    # What the output must satisfy (compiled once by the gateway's Compiler); None: free text.
    constraint: Constraint | None = None
    # Samples of the prompt (SamplingParams.n, 0 made 1); gateway/samples.py fans them out.
    n: int = 1
    # The log-probabilities the client asked for (top_logprobs implies logprobs).
    logprobs: LogprobSpec = NO_LOGPROBS
    # With logprobs.prompt_logprobs: the first prompt position scored (0 and 1: all after the first).
    prompt_logprobs_start: int = 0
    # GenerateRequest.priority is PRIORITY_BATCH: admitted after every waiting interactive
    # request (gateway/policy.py).
    is_batch: bool = False


def validate_request(req: gateway_pb2.GenerateRequest, limits: RequestLimits,
                     tokenizer: PromptTokenizer, compiler: Compiler | None = None) -> ValidatedRequest:
    """Check `req` against `limits`, tokenize its prompt and compile its constraint
    with `compiler` (None: a server without constraints); raise RequestError."""
    request_id = _check_request_id(req.request_id, limits)
    if req.priority not in _PRIORITIES:
        _fail("priority", f"must be one of {', '.join(gateway_pb2.Priority.keys())}, got {req.priority}")
    sampling = req.sampling
    spec = _sampling_spec(sampling, limits)
    n = _check_n(sampling.n, spec)
    if sampling.max_new_tokens > limits.max_new_tokens_limit:
        _fail("sampling.max_new_tokens",
              f"must be at most {limits.max_new_tokens_limit}, got {sampling.max_new_tokens}")
    stops = _check_stops(sampling.stop, limits)
    logprobs = _logprob_spec(sampling)
    constraint = _constraint(sampling, limits, compiler)
    input_field, prompt_ids = _tokenize_input(req, limits, tokenizer)
    max_new_tokens = _check_context(input_field, len(prompt_ids), sampling.max_new_tokens, limits)
    _check_prompt_logprobs_start(sampling, len(prompt_ids))
    return ValidatedRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=spec,
        stops=stops,
        ignore_eos=sampling.ignore_eos,
        constraint=constraint,
        n=n,
        logprobs=logprobs,
        prompt_logprobs_start=sampling.prompt_logprobs_start,
        is_batch=req.priority == gateway_pb2.PRIORITY_BATCH,
    )


_PRIORITIES = frozenset(gateway_pb2.Priority.values())


def _fail(field: str, detail: str) -> NoReturn:
    raise RequestError(field, f"{field} {detail}")


def _check_request_id(request_id: str, limits: RequestLimits) -> str:
    if len(request_id) > limits.max_request_id_len:
        _fail("request_id", f"must be at most {limits.max_request_id_len} characters, got {len(request_id)}")
    return request_id or uuid.uuid4().hex


def _sampling_spec(sampling: gateway_pb2.SamplingParams, limits: RequestLimits) -> SamplingSpec:
    """The request's SamplingSpec, whose own checks are the contract's; the vocabulary is this server's limit."""
    if not 0 <= sampling.top_k <= limits.vocab_size:
        _fail("sampling.top_k", f"must be in [0, {limits.vocab_size}], got {sampling.top_k}")
    try:
        return SamplingSpec(
            temperature=_shortest_float32(sampling.temperature),
            # 0 is the proto's unset value: top_p disabled.
            top_p=_shortest_float32(sampling.top_p) or 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else secrets.randbits(63))
    except SpecError as error:
        raise RequestError(error.field, str(error)) from error


def _check_n(n: int, spec: SamplingSpec) -> int:
    if n > MAX_SAMPLES:
        _fail("sampling.n", f"must be in [1, {MAX_SAMPLES}] (0 means 1), got {n}")
    if n > 1 and spec.is_greedy:
        _fail("sampling.n", f"must be 1 with greedy decoding (temperature 0), where all samples are "
                            f"the same, got {n}")
    return n or 1


def _logprob_spec(sampling: gateway_pb2.SamplingParams) -> LogprobSpec:
    """The request's LogprobSpec: the contract checks top_logprobs' range, which implies logprobs."""
    try:
        return LogprobSpec(logprobs=sampling.logprobs or sampling.top_logprobs > 0,
                           top_logprobs=sampling.top_logprobs, prompt_logprobs=sampling.prompt_logprobs)
    except SpecError as error:
        raise RequestError(error.field, str(error)) from error


def _check_prompt_logprobs_start(sampling: gateway_pb2.SamplingParams, num_prompt_tokens: int) -> None:
    start = sampling.prompt_logprobs_start
    if start and not sampling.prompt_logprobs:
        _fail("sampling.prompt_logprobs_start", f"needs sampling.prompt_logprobs, got {start} without it")
    if start >= max(num_prompt_tokens, 1):
        _fail("sampling.prompt_logprobs_start",
              f"must be below the prompt's length ({num_prompt_tokens} tokens), got {start}")


def has_constraint(req: gateway_pb2.GenerateRequest) -> bool:
    """True if the request sets SamplingParams' constraint (its validation compiles it)."""
    return req.sampling.WhichOneof("constraint") is not None


def _constraint(sampling: gateway_pb2.SamplingParams, limits: RequestLimits,
                compiler: Compiler | None) -> Constraint | None:
    """The request's Constraint, compiled (the Compiler caches it for the rank's matchers to follow)."""
    kind = sampling.WhichOneof("constraint")
    if kind is None:
        return None
    field = f"sampling.{kind}"
    if compiler is None:
        _fail(field, "is not supported by this server (GetModelInfo lists no \"constraints\" feature)")
    if sampling.ignore_eos:
        _fail("sampling.ignore_eos", f"must be false with a constraint ({field}): "
                                     "a constrained output ends with an end-of-sequence token")
    if kind == "json_object" and not sampling.json_object:
        _fail(field, "must be true (leave the constraint unset for free text)")
    if kind == "choice":
        text = tuple(sampling.choice.options)
    else:
        text = "" if kind == "json_object" else getattr(sampling, kind)
    num_chars = sum(map(len, text)) if kind == "choice" else len(text)
    if num_chars > limits.max_constraint_chars:
        _fail(field, f"must be at most {limits.max_constraint_chars} characters, got {num_chars}")
    try:
        constraint = Constraint(kind, text)
        compiler.compile(constraint)
    except ConstraintError as error:
        raise RequestError(error.field, str(error)) from error
    return constraint


def _shortest_float32(value: float) -> float:
    """The shortest decimal with the same float32 value: 0.7, not 0.699999988079071.

    Proto floats are float32; this keeps messages and logs readable.
    """
    if not math.isfinite(value):
        return value
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        try:
            if struct.unpack("f", struct.pack("f", candidate))[0] == value:
                return candidate
        except OverflowError:
            break
    return value


def _check_stops(stops: Sequence[str], limits: RequestLimits) -> tuple[str, ...]:
    if len(stops) > limits.max_stop_strings:
        _fail("sampling.stop", f"must have at most {limits.max_stop_strings} strings, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not stop:
            _fail(f"sampling.stop[{i}]", "must not be empty")
        if len(stop) > limits.max_stop_len:
            _fail(f"sampling.stop[{i}]", f"must be at most {limits.max_stop_len} characters, got {len(stop)}")
    return tuple(stops)


def _tokenize_input(req: gateway_pb2.GenerateRequest, limits: RequestLimits,
                    tokenizer: PromptTokenizer) -> tuple[str, list[int]]:
    """(the input's field name, the prompt's token ids)."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        _check_chars("prompt", len(req.prompt), limits)
        return "prompt", tokenizer.encode(req.prompt)
    if kind == "input_ids":
        ids = list(req.input_ids.ids)
        if not ids:
            _fail("input_ids.ids", "must not be empty")
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < limits.vocab_size:
                _fail(f"input_ids.ids[{i}]", f"must be in [0, {limits.vocab_size}), got {token_id}")
        return "input_ids.ids", ids
    if kind == "messages":
        return "messages.messages", tokenizer.encode_chat(_check_messages(req.messages.messages, limits))
    _fail("input", "must be set to one of prompt, input_ids, messages")


def _check_chars(field: str, num_chars: int, limits: RequestLimits) -> None:
    if num_chars == 0:
        _fail(field, "must not be empty")
    if num_chars > limits.max_prompt_chars:
        _fail(field, f"must be at most {limits.max_prompt_chars} characters, got {num_chars}")


def _check_messages(messages: Sequence[gateway_pb2.ChatMessage],
                    limits: RequestLimits) -> list[tuple[str, str]]:
    field = "messages.messages"
    if not messages:
        _fail(field, "must not be empty")
    if len(messages) > limits.max_chat_messages:
        _fail(field, f"must have at most {limits.max_chat_messages} messages, got {len(messages)}")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            _fail(f"{field}[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
    num_chars = sum(len(m.content) for m in messages)
    if num_chars > limits.max_prompt_chars:
        _fail(f"{field}[].content",
              f"must be at most {limits.max_prompt_chars} characters in all, got {num_chars}")
    return [(m.role, m.content) for m in messages]


def _check_context(input_field: str, num_prompt_tokens: int, max_new_tokens: int,
                   limits: RequestLimits) -> int:
    """max_new_tokens with the default applied; the prompt and it must fit the context.

    An explicit value that does not fit is an error; the default is cut to the
    room left, since the client did not ask for that length.
    """
    room = limits.max_context - num_prompt_tokens
    if room < 1:
        _fail(input_field, f"has {num_prompt_tokens} tokens, which leaves no room to generate "
                           f"within the context length {limits.max_context}")
    if max_new_tokens == 0:
        return min(limits.max_new_tokens_default, room)
    if max_new_tokens > room:
        _fail("sampling.max_new_tokens",
              f"is too large: prompt_tokens {num_prompt_tokens} + max_new_tokens {max_new_tokens} = "
              f"{num_prompt_tokens + max_new_tokens} exceeds the context length {limits.max_context}")
    return max_new_tokens
