"""Slow readers: a client that stops reading its stream is cut off, and its KV blocks freed.

A transport (the gRPC servicer, the HTTP endpoint) writes a stream's outputs as the Frontend
yields them. While the client reads, a write returns in microseconds; once the client stops
reading and the HTTP/2 flow-control windows are full, the write blocks, the Frontend's
generator stays suspended in its `yield`, and the request's outputs queue up behind it while
the request keeps its KV blocks on the rank (for up to its whole generation). So a stream
whose write has not returned within `timeout_s` is a slow reader: `SlowReaders.run` aborts
its requests in their engine (their blocks are freed at the next step) and ends the call: with
the transport's `end_call` where it has one (the gRPC servicer aborts the call with
RESOURCE_EXHAUSTED, which the client reads once it reads again: a cancelled handler task alone
would leave the HTTP/2 stream open until the call's deadline), else by cancelling the task that
writes (the HTTP endpoint: a no-op once its first output was taken, as the stream is written
by Starlette's task; the aborted request's response then ends with finish reason "abort").

Costs one clock read per message; the watch wakes every timeout_s / 4 (at most once a second).
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services import metrics

log = logging.getLogger("gateway.slow_readers")


class StreamWatch:
    """One stream: when its current write started (None between writes), and what to abort."""

    __slots__ = ("request_id", "writing_since", "_abort", "_task", "_end_call")

    def __init__(self, request_id: str, abort: Callable[[], None], task: asyncio.Task | None,
                 end_call: Callable[[], Awaitable[None]] | None = None) -> None:
        self.request_id = request_id
        self.writing_since: float | None = None
        self._abort = abort
        self._task = task
        self._end_call = end_call

    def start_write(self) -> None:
        self.writing_since = time.monotonic()

    def end_write(self) -> None:
        self.writing_since = None

    def cut_off(self) -> asyncio.Future | None:
        """Aborts the stream's requests and ends its call: end_call's task (returned), else
        the writing task cancelled."""
        self._abort()
        if self._end_call is not None:
            return asyncio.ensure_future(self._end_call())
        if self._task is not None and not self._task.done():
            self._task.cancel()
        return None


class SlowReaders:
    """The open streams of one gateway, and the watch that cuts off those stuck in a write."""

    def __init__(self, timeout_s: float) -> None:
        # 0: never cut off (the streams are still tracked; nothing scans them).
        self.timeout_s = timeout_s
        self._streams: set[StreamWatch] = set()
        # The end_call tasks still running (kept referenced until done).
        self._ending: set[asyncio.Future] = set()
        self.num_cut_off = 0

    def open(self, request_id: str, abort: Callable[[], None],
             end_call: Callable[[], Awaitable[None]] | None = None) -> StreamWatch:
        """Tracks a stream written by the current task; abort() ends its requests, end_call()
        (if given) its call."""
        watch = StreamWatch(request_id, abort, asyncio.current_task(), end_call)
        self._streams.add(watch)
        return watch

    def close(self, watch: StreamWatch) -> None:
        self._streams.discard(watch)

    def cut_off_stalled(self, now: float) -> int:
        """Cuts off every stream whose write started more than timeout_s before now; how many."""
        stalled = [w for w in self._streams
                   if w.writing_since is not None and now - w.writing_since > self.timeout_s]
        for watch in stalled:
            log.warning("request %s: the client has not read its stream for %.0f s; aborted",
                        watch.request_id, now - watch.writing_since)
            self._streams.discard(watch)
            ending = watch.cut_off()
            if ending is not None:
                self._ending.add(ending)
                ending.add_done_callback(self._ending.discard)
        self.num_cut_off += len(stalled)
        return len(stalled)

    async def run(self) -> None:
        """Scans the streams every timeout_s / 4 (at most every second) until cancelled."""
        if not self.timeout_s:
            return
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            self.cut_off_stalled(time.monotonic())


class SlowReaderCollector:
    """Scrape-time metric of a SlowReaders (None: the family without a sample)."""

    def __init__(self, readers: SlowReaders | None) -> None:
        self._readers = readers

    def collect(self):
        cut = metrics.counter_family("slow_reader_cutoffs", "Streams cut off because their client stopped "
                                     "reading for --slow-reader-timeout-s (their requests aborted).")
        if self._readers is not None:
            cut.add_metric([], self._readers.num_cut_off)
        yield cut
