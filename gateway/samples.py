"""A request's n samples (SamplingParams.n): one sequence each, one stream for all.

`sample_requests` splits a ValidatedRequest with n > 1 into n requests of one
sample each: sample i draws with seed + i (mod 2**64), so a seeded request
gives the same n samples each time, and sample i of it the tokens that a
request with seed + i gives. An unseeded request got a random seed in
validation, so each of its samples draws from its own random seed.

The Frontend submits all n at once, the later ones with the first as their
leader (Sequence.leader): admission starts them once the first one's prompt is
in its rank's prefix cache, on that rank, so the prompt is prefilled once and
the later samples report it in Usage.cached_tokens (gateway/admission.py).

`interleave` reads the samples' handles concurrently, one task each, and
yields their outputs as they come, each stamped with its sample's index; the
first error of any sample ends the whole stream (the caller aborts the rest).
With coalescing, what a stream that fell behind finds queued is merged per
sample (never across samples: each index keeps its own tokens and finish).

No gRPC here: gateway/frontend.py drives it for every transport.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from gateway.requests import RequestHandle, RequestOutput, merge_outputs
from gateway.validation import ValidatedRequest

_SEED_MODULUS = 2**64


def sample_requests(request: ValidatedRequest) -> list[ValidatedRequest]:
    """The request's samples, in index order: the request itself when n is 1."""
    if request.n == 1:
        return [request]
    # Only the first sample scores the prompt: a sequence that scores it takes no cached prefix past
    # its first scored position, so scoring it in every sample would prefill that part n times.
    later = dataclasses.replace(request.logprobs, prompt_logprobs=False)
    return [dataclasses.replace(request, n=1, logprobs=request.logprobs if i == 0 else later,
                                sampling=dataclasses.replace(
                                    request.sampling, seed=(request.sampling.seed + i) % _SEED_MODULUS))
            for i in range(request.n)]


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Each sample's outputs among `outputs` merged into one, in the order of the
    samples' first outputs there."""
    by_index: dict[int, list[RequestOutput]] = {}
    for output in outputs:
        by_index.setdefault(output.index, []).append(output)
    return [merge_outputs(group) for group in by_index.values()]


@dataclasses.dataclass(frozen=True, slots=True)
class _Failed:
    error: Exception


_DONE = object()


async def interleave(handles: Sequence[RequestHandle], *, coalesce_outputs: bool = True
                     ) -> AsyncIterator[RequestOutput]:
    """The outputs of every handle (sample i: handles[i]) as they come, with index i,
    until each has given its final one; raises the first error of any."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for output in handle:
                queue.put_nowait(dataclasses.replace(output, index=index))
        except Exception as error:  # handed to the reader, which raises it
            queue.put_nowait(_Failed(error))
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(i, handle)) for i, handle in enumerate(handles)]
    num_open = len(tasks)
    try:
        while num_open:
            items = [await queue.get()]
            while coalesce_outputs and not queue.empty():
                items.append(queue.get_nowait())
            outputs: list[RequestOutput] = []
            failed: _Failed | None = None
            for item in items:
                if item is _DONE:
                    num_open -= 1
                elif isinstance(item, _Failed):
                    failed = failed or item
                else:
                    outputs.append(item)
            for output in coalesce(outputs) if coalesce_outputs else outputs:
                yield output
            if failed is not None:
                raise failed.error
    finally:
        for task in tasks:
            task.cancel()
