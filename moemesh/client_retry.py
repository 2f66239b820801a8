"""The Python client's call policy: deadlines, retries with backoff, and the caller's trace context.

Retries: a call that fails with UNAVAILABLE (no gateway reachable, or one
without a worker group) is tried again, up to `max_attempts` in all, after an
exponential backoff with full jitter (a uniform draw in [0, backoff], as
gRPC's own retry policy does, so that many clients do not retry in step).
Only UNAVAILABLE, and for Generate only before its first message arrived:
after a token was delivered a restart would silently repeat (or, sampling,
change) what the caller has, so the error is raised instead. No retry sleeps
past the call's deadline.

Deadline: `timeout` bounds the whole call, retries and backoff included.

Trace context: each attempt carries the caller's OpenTelemetry context as
W3C `traceparent` (and `tracestate`, baggage: whatever the global propagator
writes) in its metadata, which the gateway's server interceptor continues.
"""

from __future__ import annotations

import dataclasses
import random
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How calls that fail with UNAVAILABLE are retried."""

    # Attempts in all, the first included (1: never retry).
    max_attempts: int = 5
    # The backoff before the second attempt; multiplied by backoff_multiplier after each, up to max_backoff_s.
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoffs must satisfy 0 <= initial_backoff_s <= max_backoff_s, got "
                             f"{self.initial_backoff_s} and {self.max_backoff_s}")
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be at least 1, got {self.backoff_multiplier}")

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """The jittered pause after failed attempt number `attempt` (from 1)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.backoff_multiplier ** (attempt - 1))
        return (rng or random).uniform(0.0, cap)

    def retry_delay(self, code: grpc.StatusCode, attempt: int, deadline: Deadline) -> float | None:
        """The pause before the next attempt after failed attempt `attempt` ended with `code`; None: give up."""
        if code != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_attempts:
            return None
        delay = self.backoff_s(attempt)
        remaining = deadline.remaining()
        if remaining is not None and delay >= remaining:
            return None
        return delay


NO_RETRY = RetryPolicy(max_attempts=1, initial_backoff_s=0.0, max_backoff_s=0.0)


class Deadline:
    """The end of a call's time (None: no deadline)."""

    __slots__ = ("_end",)

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        """Seconds left (at least a millisecond, so that an expired deadline still fails as one); None: none."""
        return None if self._end is None else max(self._end - time.monotonic(), 0.001)


def call_metadata(extra: tuple[tuple[str, str], ...] = (),
                  context: otel_context.Context | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata of one call: the client's own entries, then the caller's trace context (current by default)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(extra) + tuple(carrier.items())
