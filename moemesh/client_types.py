"""The Python client's values: plain dataclasses for what the gateway answers, converted from its messages.

Callers of `moemesh.Client` never see a protobuf: a stream yields `Chunk`s,
`generate` returns a `GenerateResult` (one `Sample` per sample of `n`), and
`model_info` a `ModelInfo`. Finish reasons are OpenAI's words ("stop",
"length", "abort"; None while a sample runs).
"""

from __future__ import annotations

import dataclasses

from moe.gateway.v1 import gateway_pb2

FINISH_REASONS = {
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclasses.dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability given the tokens before it, and the most likely alternatives there."""

    token_id: int
    logprob: float
    # Most likely first; empty unless top_logprobs was asked for.
    top: tuple[TopLogprob, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a sample (or, in GenerateResult.usage, of the whole request)."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV came from the prefix cache.
    cached_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One message of a stream: what one sample generated since its previous chunk."""

    request_id: str
    # Which of the request's n samples, from 0.
    index: int
    text: str
    token_ids: tuple[int, ...]
    # One per token of token_ids with logprobs (or top_logprobs); else empty.
    logprobs: tuple[TokenLogprob, ...] = ()
    # With prompt_logprobs, on the first chunk of sample 0: one per prompt token after the first
    # (from prompt_logprobs_start on).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # Set on the sample's last chunk only.
    finish_reason: str | None = None
    matched_stop: str = ""
    usage: Usage | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One whole sample of a request."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    matched_stop: str = ""
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished request: its samples, by index; text, token_ids, finish_reason and logprobs are sample 0's."""

    request_id: str
    samples: tuple[Sample, ...]
    # The request's: the prompt counted once, the completion tokens of every sample.
    usage: Usage | None

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.samples[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return self.samples[0].logprobs

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        return self.samples[0].prompt_logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model and the worker group that serves it (GetModelInfo)."""

    model_name: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    num_experts: int
    num_experts_per_tok: int
    # 0 while the gateway has no worker group.
    num_ranks: int
    # Optional features the server supports: "prefix_cache", "constraints", ...
    features: tuple[str, ...]


def _logprobs(messages) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top))
                 for lp in messages)


def chunk_from_proto(response: gateway_pb2.GenerateResponse) -> Chunk:
    """The Chunk of one GenerateResponse."""
    finished = response.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
    usage = response.usage
    return Chunk(
        request_id=response.request_id,
        index=response.index,
        text=response.text,
        token_ids=tuple(response.token_ids),
        logprobs=_logprobs(response.logprobs),
        prompt_logprobs=_logprobs(response.prompt_logprobs),
        finish_reason=FINISH_REASONS.get(response.finish_reason, "unknown") if finished else None,
        matched_stop=response.matched_stop,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        if response.HasField("usage") else None,
    )


def model_info_from_proto(info: gateway_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=info.model_name, architecture=info.architecture, context_length=info.context_length,
        vocab_size=info.vocab_size, dtype=info.dtype, num_experts=info.num_experts,
        num_experts_per_tok=info.num_experts_per_tok, num_ranks=info.num_ranks, features=tuple(info.features))


class ResultBuilder:
    """Gathers a stream's chunks into a GenerateResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self._chunks: dict[int, list[Chunk]] = {}

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self._chunks.setdefault(chunk.index, []).append(chunk)

    def result(self) -> GenerateResult:
        samples = tuple(_sample(index, self._chunks[index]) for index in sorted(self._chunks))
        usages = [s.usage for s in samples if s.usage is not None]
        usage = Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                      usages[0].cached_tokens) if usages else None
        return GenerateResult(self.request_id, samples, usage)


def _sample(index: int, chunks: list[Chunk]) -> Sample:
    last = chunks[-1]
    return Sample(
        index=index,
        text="".join(c.text for c in chunks),
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        finish_reason=last.finish_reason,
        matched_stop=last.matched_stop,
        usage=last.usage,
        logprobs=tuple(lp for c in chunks for lp in c.logprobs),
        prompt_logprobs=tuple(lp for c in chunks for lp in c.prompt_logprobs),
    )
