"""MemberSession: a process's registration under one lease, kept alive in the background.

Every process registers itself under one lease (its session); closing the
client revokes the lease, so peers see the departure at once instead of
after the TTL. A session is declared lost (its `lost` event is set: a
scheduler leader steps down on it) at the first keepalive that fails, since
the lease may then expire before the next one gets through. The keepalive
goes on refreshing the same lease: once etcd answers that it is alive (an
etcd restart keeps leases and restarts their TTLs), a new session on that
lease replaces the lost one and the member's keys never left; only if etcd
says the lease is gone is a new one granted and the member key put again.
So an etcd blip costs no process its membership. close() finishes in
bounded time even if etcd never answers.
"""

import asyncio
import dataclasses
import logging
import time

from services import metrics, telemetry
from services.cluster.connection import (CLOSE_TASKS_S, ETCD_ERRORS, ClusterUnavailableError, EtcdConnection,
                                         cancel_and_wait)
from services.cluster.records import ROLES, member_value

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Session:
    """One lease of this process, for as long as its keepalive vouches for it.

    `lost` is set at the first refresh that fails, or once etcd says the
    lease is gone, and is never cleared: a lease that turns out alive goes
    on in a new Session with the same lease_id (see the module docstring)."""

    lease_id: int
    ttl: int
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # When the last successful refresh was sent (time.monotonic()).
    last_renewed: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True, slots=True)
class _Registration:
    role: str
    member_id: str
    address: str
    info: dict
    ttl: int


def raise_unless_lease_gone(error: Exception, session: Session) -> None:
    """A write under session's lease failed: if because etcd no longer has the
    lease (revoked or expired before the keepalive noticed), marks the session
    lost (the keepalive then registers anew) and returns; else re-raises."""
    if not is_lease_gone(error):
        raise error
    log.warning("lease %x is gone (%s); waiting for a new session", session.lease_id, error)
    session.lost.set()


def is_lease_gone(error: Exception) -> bool:
    """True if etcd refused a write because the lease it names does not exist."""
    return "lease not found" in str(error)


class MemberSession(EtcdConnection):
    """An etcd connection that registers this process under a kept-alive lease."""

    def __init__(self, endpoint: str, **kwargs):
        super().__init__(endpoint, **kwargs)
        self._registration: _Registration | None = None
        self._session: Session | None = None
        self._session_changed = asyncio.Condition()
        self._keepalive_task: asyncio.Task | None = None

    @telemetry.traced("etcd.register")
    async def register(self, role: str, member_id: str, address: str,
                       info: dict | None = None, ttl: int = 2) -> None:
        """Puts /members/<role>/<member_id> under a new lease kept alive in the background."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if self._registration is not None:
            raise RuntimeError(f"already registered as {self._registration.member_id!r}")
        self._registration = _Registration(role, member_id, address, dict(info or {}), ttl)
        await self._new_session()
        self._keepalive_task = asyncio.create_task(self._keepalive(), name=f"keepalive-{member_id}")

    async def update_info(self, info: dict) -> None:
        """Merges `info` into the registered member's info and writes the member key again under
        the current lease (a re-registration after a lost lease keeps it too)."""
        reg = self._registration
        if reg is None:
            raise RuntimeError("update_info before register")
        self._registration = reg = dataclasses.replace(reg, info={**reg.info, **info})
        session = await self.live_session()
        await self._retry("register", self._etcd.put, self.keys.member(reg.role, reg.member_id).encode(),
                          member_value(reg.role, reg.member_id, reg.address, reg.info), lease=session.lease_id)

    @property
    def session(self) -> Session | None:
        """The current session (None before register); check `session.lost`."""
        return self._session

    async def live_session(self) -> Session:
        """The current session once it is not lost (waits until etcd confirms the
        lease again, or a new one is registered). Raises ClusterUnavailableError
        once the client is closed."""
        async with self._session_changed:
            await self._session_changed.wait_for(
                lambda: self._closed or (self._session is not None and not self._session.lost.is_set()))
            if self._closed:
                raise ClusterUnavailableError(f"etcd at {self.endpoint}: client closed")
            return self._session

    async def close(self) -> None:
        """Revokes the lease first (peers see us leave, and a leader's term ends,
        at once), then stops the keepalive and closes the channel. Takes a few
        seconds at most, even if etcd does not answer."""
        if self._closed:
            return
        self._closed = True  # from here on the keepalive neither refreshes nor registers again
        session = self._session
        if session is not None:
            session.lost.set()
            await self.revoke_lease(session.lease_id)
        async with self._session_changed:
            self._session_changed.notify_all()  # live_session() waiters raise
        await cancel_and_wait([self._keepalive_task], CLOSE_TASKS_S, what="keepalive")
        if self._session is not session:  # registered again meanwhile: that lease goes too
            self._session.lost.set()
            await self.revoke_lease(self._session.lease_id)
        await self._close_channel()

    async def _new_session(self) -> None:
        """Grants a lease and registers the member key under it (retries until it works)."""
        reg = self._registration
        lease = await self._retry("lease", self._etcd.lease, reg.ttl, budget_s=None)
        await self._retry("register", self._etcd.put, self.keys.member(reg.role, reg.member_id).encode(),
                          member_value(reg.role, reg.member_id, reg.address, reg.info), lease=lease.id,
                          budget_s=None)
        await self._publish_session(Session(lease.id, reg.ttl))
        log.info("registered %s %s at %s (lease %x, ttl %ds)", reg.role, reg.member_id,
                 reg.address, lease.id, reg.ttl)

    async def _keepalive(self) -> None:
        """Refreshes the lease every ttl/3. A failed refresh marks the session
        lost at once and is retried with backoff; see the module docstring."""
        delay = 0.05
        while not self._closed:
            session = self._session
            interval = session.ttl / 3
            sent = time.monotonic()
            try:
                reply = await self._call("keepalive", self._etcd.refresh_lease, session.lease_id,
                                         timeout_s=interval)
                if reply is None:
                    raise ConnectionError("the keepalive stream ended without a reply")
            except ETCD_ERRORS as error:
                metrics.count_etcd_error("keepalive")
                # Warn once per outage; the retries that follow log at debug.
                log.log(logging.DEBUG if session.lost.is_set() else logging.WARNING,
                        "keepalive of lease %x failed: %r; session lost until etcd confirms the lease",
                        session.lease_id, error)
                session.lost.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, interval)
                continue
            if self._closed:  # close() revokes the lease and sets lost itself
                return
            delay = 0.05
            if reply.TTL <= 0:
                log.warning("lease %x expired; registering again", session.lease_id)
                session.lost.set()
                await self._replace_session()
                continue
            if session.lost.is_set():
                await self._publish_session(Session(session.lease_id, session.ttl, last_renewed=sent))
                log.info("lease %x confirmed alive again: session resumed", session.lease_id)
            else:
                session.last_renewed = sent
            await asyncio.sleep(max(0.0, sent + interval - time.monotonic()))

    async def _publish_session(self, session: Session) -> None:
        async with self._session_changed:
            self._session = session
            self._session_changed.notify_all()

    async def _replace_session(self) -> None:
        """Registers again under a new lease (the old one is gone), until it works."""
        delay = 0.05
        while not self._closed:
            try:
                await self._new_session()
                return
            except (*ETCD_ERRORS, ClusterUnavailableError) as error:
                if self._closed:
                    return
                log.warning("re-registration failed: %r; retrying in %.2fs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
