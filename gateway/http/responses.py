"""OpenAI's response bodies and stream chunks, from the gateway's RequestOutputs.

`ResponseState` follows one request's outputs: a Choice per sample (routed by
RequestOutput.index: the n samples of one prompt), the usage (the prompt
counted once, the completions of every sample), and, while streaming, one
chunk per output. Log-probabilities are mapped from plain
(token_id, logprob, [(token_id, logprob), ...]) entries aligned with the
generated tokens: the completions API's tokens/token_logprobs/top_logprobs/
text_offset, and the chat API's content items with token, logprob, bytes and
top_logprobs. Pure: no I/O, no framework.
"""

import dataclasses
import time
from collections.abc import Callable, Sequence

from gateway.http.openai_api import ApiRequest
from gateway.requests import FinishReason, RequestOutput

# One generated position: its token, its log-probability, the most likely tokens there.
LogprobEntry = tuple[int, float, Sequence[tuple[int, float]]]

_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH_REASONS[reason]


@dataclasses.dataclass(slots=True)
class Choice:
    """One sample, accumulated from its outputs."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    logprobs: list[LogprobEntry] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)

    def add(self, output: RequestOutput, entries: Sequence[LogprobEntry] = ()) -> None:
        self.text += output.text
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(entries)
        self.completion_tokens = output.completion_tokens
        if output.is_final:
            self.finish_reason = finish_reason(output.finish_reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: Sequence[LogprobEntry], token_bytes: Callable[[int], bytes],
                        text_offset: int = 0) -> dict:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    def text(token_id: int) -> str:
        return token_bytes(token_id).decode("utf-8", errors="replace")

    tokens, offsets = [], []
    for token_id, _, _ in entries:
        offsets.append(text_offset)
        tokens.append(text(token_id))
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [{text(t): lp for t, lp in top} for _, _, top in entries],
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[LogprobEntry], token_bytes: Callable[[int], bytes]) -> dict:
    """The chat API's logprobs object: content, one item per token with its top_logprobs."""
    def item(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(token_id, logprob), "top_logprobs": [item(t, lp) for t, lp in top]}
                        for token_id, logprob, top in entries]}


def _logprobs_of(api: ApiRequest, choice: Choice, token_bytes, text_offset: int = 0) -> dict | None:
    if api.num_top_logprobs is None:
        return None
    if api.is_chat:
        return chat_logprobs(choice.logprobs, token_bytes)
    return completion_logprobs(choice.logprobs, token_bytes, text_offset)


def response_body(api: ApiRequest, response_id: str, created: int, model: str, choices: Sequence[Choice],
                  usage_: dict, token_bytes: Callable[[int], bytes]) -> dict:
    """The whole (non-streaming) response."""
    if api.is_chat:
        items = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": _logprobs_of(api, c, token_bytes), "finish_reason": c.finish_reason}
                 for c in choices]
        kind = "chat.completion"
    else:
        items = [{"index": c.index, "text": c.text, "logprobs": _logprobs_of(api, c, token_bytes),
                  "finish_reason": c.finish_reason} for c in choices]
        kind = "text_completion"
    if api.return_token_ids:
        for item, choice in zip(items, choices):
            item["token_ids"] = choice.token_ids
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": items,
            "usage": usage_}


def chunk_body(api: ApiRequest, response_id: str, created: int, model: str, choice: Choice, text: str,
               *, is_first: bool, token_bytes: Callable[[int], bytes], text_offset: int = 0) -> dict:
    """One streamed chunk of one sample: the text since its previous chunk (choice.logprobs: its tokens')."""
    logprobs = _logprobs_of(api, choice, token_bytes, text_offset)
    if api.is_chat:
        delta = {"role": "assistant", "content": text} if is_first else {"content": text}
        item = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        kind = "chat.completion.chunk"
    else:
        item = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        kind = "text_completion"
    if api.return_token_ids:
        item["token_ids"] = choice.token_ids
    body = {"id": response_id, "object": kind, "created": created, "model": model, "choices": [item]}
    if api.include_usage:
        body["usage"] = None
    return body


def usage_chunk(api: ApiRequest, response_id: str, created: int, model: str, usage_: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if api.is_chat else "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage_}


def logprob_entries(output: RequestOutput) -> list[LogprobEntry]:
    """The output's log-probabilities as entries aligned with its token_ids (none when not asked for).

    RequestOutput.logprobs holds objects with token_id, logprob and top ((token_id, logprob) pairs,
    most likely first): services.step.TokenLogprob.
    """
    return [(lp.token_id, lp.logprob, lp.top) for lp in output.logprobs]


class ResponseState:
    """One request's response as its outputs arrive (see the module docstring)."""

    def __init__(self, api: ApiRequest, response_id: str, model: str,
                 token_bytes: Callable[[int], bytes]) -> None:
        self.api = api
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_bytes = token_bytes
        self.choices: dict[int, Choice] = {}
        self.prompt_tokens = self.cached_tokens = 0

    def add(self, output: RequestOutput) -> list[dict]:
        """Takes one output; returns the stream chunks it makes (none unless streaming)."""
        is_first = output.index not in self.choices
        choice = self.choices.setdefault(output.index, Choice(output.index))
        entries = logprob_entries(output)
        text_offset = len(choice.text)
        choice.add(output, entries)
        self.prompt_tokens = output.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, output.cached_tokens)
        has_news = output.text or output.is_final or entries or is_first or self.api.return_token_ids
        if not self.api.stream or not has_news:
            return []
        piece = Choice(output.index, finish_reason=finish_reason(output.finish_reason), logprobs=list(entries),
                       token_ids=list(output.token_ids))
        return [chunk_body(self.api, self.response_id, self.created, self.model, piece, output.text,
                           is_first=is_first, token_bytes=self.token_bytes, text_offset=text_offset)]

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices.values()),
                     self.cached_tokens)

    def body(self) -> dict:
        """The non-streaming response."""
        choices = [self.choices[i] for i in sorted(self.choices)]
        return response_body(self.api, self.response_id, self.created, self.model, choices, self.usage(),
                             self.token_bytes)

    def usage_chunk(self) -> dict:
        return usage_chunk(self.api, self.response_id, self.created, self.model, self.usage())
