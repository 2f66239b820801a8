"""Fencing: a rank whose etcd lease may have expired runs no step of its epoch.

The scheduler replaces a rank whose member key is gone (its lease expired:
the process died, hung, or its host lost the network) with a standby, in a
new epoch of the group. A rank cut off from etcd cannot tell whether that
has happened, so once its lease has gone a whole TTL without a renewal
(it may have expired in etcd), it holds every step of its epoch: a plan
that arrives waits, the rank turns NOT_SERVING. What comes next decides:

- etcd confirms the same lease alive (an etcd outage or a slow network:
  nothing could have replaced the rank): the hold is lifted, the held
  plans run, nothing was lost;
- a new lease (the old one expired): the held epoch fails like a failed
  step (expert_svc/server.py reports it and leaves the process group);
  the assignment watch then finds the rank either replaced (it exits and
  comes back as a standby) or kept in a new epoch (it rejoins).

A new epoch joined meanwhile is not touched: the hold, and its outcome,
belong to the executor that was serving when the lease went quiet.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from expert_svc.state import RankState
from services.cluster.session import Session

if TYPE_CHECKING:  # torch-heavy; only the annotation needs it
    from expert_svc.executor import StepExecutor

log = logging.getLogger("expert_svc")

# How often the lease is looked at, as a share of its TTL (a hold starts at most this late).
CHECKS_PER_TTL = 10


async def watch_lease(session_of: Callable[[], Session | None], *, on_hold: Callable[[], Awaitable[None]],
                      on_lift: Callable[[], Awaitable[None]], on_expired: Callable[[], Awaitable[None]]) -> None:
    """Runs until cancelled: on_hold once the current lease has gone a TTL without renewal; then on_lift
    when a live session on the same lease is back, on_expired when a live one on another lease is."""
    held_lease: int | None = None
    held_renewal = 0.0  # the last renewal before the hold: lifting takes a later one
    while True:
        session = session_of()
        ttl = session.ttl if session is not None else 1
        if session is not None:
            if held_lease is None:
                quiet_s = time.monotonic() - session.last_renewed
                if quiet_s >= session.ttl:
                    held_lease, held_renewal = session.lease_id, session.last_renewed
                    log.warning("fenced: lease %x not renewed for %.1f s (ttl %d s); holding this epoch's "
                                "steps until etcd answers", session.lease_id, quiet_s, session.ttl)
                    await on_hold()
            elif not session.lost.is_set() and (session.lease_id != held_lease
                                                or session.last_renewed > held_renewal):
                if session.lease_id == held_lease:
                    log.info("lease %x confirmed alive: fence lifted", held_lease)
                    await on_lift()
                else:
                    log.warning("lease %x expired (now %x): the fenced epoch is given up", held_lease,
                                session.lease_id)
                    await on_expired()
                held_lease = None
        await asyncio.sleep(ttl / CHECKS_PER_TTL)


class RankFence:
    """What fencing does to a rank: holds its serving executor, then lifts or fails that one only."""

    def __init__(self, state: RankState, set_serving: Callable[[bool], Awaitable[None]]):
        self._state = state
        self._set_serving = set_serving
        self._held: "StepExecutor | None" = None

    async def hold(self) -> None:
        executor = self._state.executor
        if executor is None or executor.failure is not None:
            return  # not serving an epoch: nothing to fence
        self._held = executor
        executor.hold()
        await self._set_serving(False)

    async def lift(self) -> None:
        executor, self._held = self._held, None
        if executor is not None and executor is self._state.executor and executor.failure is None:
            executor.release()
            await self._set_serving(True)

    async def expire(self) -> None:
        executor, self._held = self._held, None
        if executor is not None and executor is self._state.executor:
            executor.fail("fenced: the rank's etcd lease expired, so the scheduler may have replaced it")


def start(state: RankState, set_serving: Callable[[bool], Awaitable[None]],
          session_of: Callable[[], Session | None]) -> asyncio.Task:
    """Fences the rank whenever its lease goes quiet (until the task is cancelled)."""
    fence = RankFence(state, set_serving)
    return asyncio.create_task(watch_lease(session_of, on_hold=fence.hold, on_lift=fence.lift,
                                           on_expired=fence.expire), name="fence")
