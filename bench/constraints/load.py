"""The loads of bench/constraints/gpu_constraints.py: constrained answers beside free 1K/1K decodes.

A constrained request asks for the ticket-classifier JSON (bench/constraints/engines.py's
TICKET_SCHEMA) greedily, with no ignore_eos: it ends when the schema is complete (FINISH_REASON_STOP)
or at its max_new_tokens. Its unconstrained twin is a prompt of the same length with ignore_eos
and max_new_tokens set to the length the constrained answer had, so a baseline run generates the
very same numbers of tokens without any mask (each run its own prompts: the prefix cache would
otherwise skip the baseline's prefills).

`mixed_load` keeps one request in flight in each of `len(free)` free slots (1K/1K, each slot its
own specs in turn) and `constrained_slots` constrained slots, every slot sending one request after
the other, for a fixed window of seconds; then it cancels what is still in flight. Its baseline
(the twins, replaying the recorded lengths in turn) runs the same slots over the same window, so
the two runs' output tokens received within the window compare like for like.
"""

import asyncio
import dataclasses
import json
import time

import grpc

from bench.constraints.engines import TICKET_SCHEMA
from bench.serving.serve import RequestResult, generate_request
from bench.serving.workloads import RequestSpec
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc

TICKET_SCHEMA_TEXT = json.dumps(TICKET_SCHEMA)
TICKET_KEYS = set(TICKET_SCHEMA["required"])


@dataclasses.dataclass(slots=True)
class Answer:
    """One request's stream as the client saw it, plus what a constrained answer needs checked."""

    timing: RequestResult
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    # (perf_counter, tokens) of each streamed message that carried tokens.
    arrivals: list[tuple[float, int]] = dataclasses.field(default_factory=list)

    @property
    def is_done(self) -> bool:
        """The stream ended (a finish reason or an error), not cancelled at a window's end."""
        return bool(self.finish_reason or self.timing.error)


def constrained_request(request_id: str, prompt_ids, max_new_tokens: int) -> gateway_pb2.GenerateRequest:
    """Greedy, the ticket schema, EOS ends it."""
    return gateway_pb2.GenerateRequest(
        request_id=request_id, input_ids=gateway_pb2.TokenIds(ids=prompt_ids),
        sampling=gateway_pb2.SamplingParams(max_new_tokens=max_new_tokens, json_schema=TICKET_SCHEMA_TEXT))


def twin_request(request_id: str, prompt_ids, num_tokens: int) -> gateway_pb2.GenerateRequest:
    """The unconstrained twin: exactly num_tokens out."""
    return generate_request(RequestSpec("twin", tuple(prompt_ids), max(1, num_tokens)), request_id)


async def stream(stub, request: gateway_pb2.GenerateRequest, kind: str, timeout_s: float,
                 answer: Answer | None = None) -> Answer:
    """Sends one request and times its stream (ITL as bench/serving/serve.py counts it), into
    `answer` if given (a window's end may cancel it half way)."""
    answer = answer or Answer(RequestResult(kind, time.perf_counter()))
    result, last = answer.timing, answer.timing.start_s
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            num = len(response.token_ids)
            answer.text += response.text
            if response.finish_reason:
                answer.finish_reason = gateway_pb2.FinishReason.Name(response.finish_reason)
            if not num:
                continue
            if result.first_token_s is None:
                result.first_token_s = now
                result.itl_s += [0.0] * (num - 1)
            else:
                result.itl_s += [(now - last) / num] * num
            result.num_output_tokens += num
            answer.arrivals.append((now, num))
            answer.token_ids += response.token_ids
            last = now
    except grpc.aio.AioRpcError as error:
        result.error = error.code().name
    result.end_s = time.perf_counter()
    return answer


def is_valid_ticket(text: str) -> bool:
    """The answer parses as JSON with exactly the schema's keys (the server enforces the rest)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == TICKET_KEYS


def check_answers(answers: list[Answer]) -> dict:
    """Finish reasons and valid JSON among constrained answers, and their lengths."""
    reasons: dict[str, int] = {}
    for a in answers:
        reasons[a.finish_reason or a.timing.error or "none"] = reasons.get(a.finish_reason or a.timing.error
                                                                          or "none", 0) + 1
    stopped = [a for a in answers if a.finish_reason == "FINISH_REASON_STOP"]
    lengths = sorted(a.timing.num_output_tokens for a in answers)
    return {"finish_reasons": reasons, "valid_json": sum(is_valid_ticket(a.text) for a in stopped),
            "stopped": len(stopped), "tokens_mean": round(sum(lengths) / len(lengths), 1) if lengths else 0,
            "tokens_max": lengths[-1] if lengths else 0}


async def mixed_load(target: str, free: list[list[RequestSpec]], prompts: list[tuple[int, ...]],
                     constrained_slots: int, max_new_tokens: int, timeout_s: float, tag: str, window_s: float,
                     replay: list[int] | None = None) -> tuple[list[Answer], list[Answer], float]:
    """Free slot i sends free[i]'s specs in turn, each of constrained_slots slots constrained requests
    (with `replay`: their unconstrained twins, of the recorded lengths in turn), for window_s seconds;
    then what is in flight is cancelled. (free answers, constrained answers, window_s), the answers
    cut at the window's end included (Answer.is_done false)."""
    free_answers: list[Answer] = []
    constrained_answers: list[Answer] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)

        async def free_worker(slot: int, specs: list[RequestSpec]) -> None:
            for i, spec in enumerate(specs):
                answer = Answer(RequestResult(spec.kind, time.perf_counter()))
                free_answers.append(answer)
                await stream(stub, generate_request(spec, f"{tag}-free-{slot}-{i}"), spec.kind, timeout_s, answer)

        async def constrained_worker() -> None:
            while True:
                i = len(constrained_answers)
                answer = Answer(RequestResult("json" if replay is None else "twin", time.perf_counter()))
                constrained_answers.append(answer)
                prompt = prompts[i % len(prompts)]
                request = (constrained_request(f"{tag}-json-{i}", prompt, max_new_tokens) if replay is None
                           else twin_request(f"{tag}-twin-{i}", prompt, replay[i % len(replay)]))
                await stream(stub, request, answer.timing.kind, timeout_s, answer)

        tasks = [asyncio.create_task(free_worker(slot, specs)) for slot, specs in enumerate(free)]
        tasks += [asyncio.create_task(constrained_worker()) for _ in range(constrained_slots)]
        await asyncio.sleep(window_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return free_answers, constrained_answers, window_s


async def serial(target: str, prompts: list[tuple[int, ...]], max_new_tokens: int, timeout_s: float, tag: str,
                 replay: list[int] | None = None) -> tuple[list[Answer], float]:
    """Batch 1: one constrained answer (or, with `replay`, its twin) after the other; (answers, seconds)."""
    answers = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            request = (constrained_request(f"{tag}-json-{i}", prompt, max_new_tokens) if replay is None
                       else twin_request(f"{tag}-twin-{i}", prompt, replay[i]))
            answers.append(await stream(stub, request, "json" if replay is None else "twin", timeout_s))
        return answers, time.perf_counter() - start
