"""EtcdConnection: bounded etcd calls, retries and watches, the base of ClusterClient.

etcd being unreachable is survivable: one-shot calls retry with backoff for
up to `retry_s` and then raise ClusterUnavailableError; watches retry until
close(). At start, though, an etcd that no endpoint even accepts a TCP
connection for (a wrong --etcd, a firewall, etcd not started) fails
`connect` within `reach_timeout_s` with an error naming every endpoint,
instead of a silent wait: only an etcd that listens but does not answer yet
(no quorum) is waited for as long as the caller asks.

Several endpoints (an etcd cluster: "h1:2379,h2:2379,h3:2379") make one
gRPC channel over all of them, with gRPC's pick_first policy: it uses the
first that accepts a connection and, when that connection is lost, tries
them again in order. Names are resolved once, here (gRPC's static address
lists take IP addresses). Watches yield a state only when it changes: a watch that breaks
and is re-established (an etcd restart) reads the state again and yields
nothing if it is unchanged.

Nothing here waits on etcd without a deadline, and no cancellation is lost:
every etcd call runs in a task of its own that the caller waits for with
asyncio.wait (at most `call_timeout_s` plus a grace; a call that misses it
is cancelled and abandoned, and counts as etcd being unreachable). Never
asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as
the awaited call completes (CPython gh-86296), which once left the
keepalive running after close() had cancelled it, and close() waiting for
it forever. Each watch is a gRPC stream of its own, cancelled
synchronously, rather than aetcd's shared Watcher (whose locks and bounded
request queue can block cancel and close for good).
"""

import asyncio
import collections.abc
import contextlib
import logging
import socket
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import aetcd
import grpc
from aetcd import rpc as etcd_rpc
from aetcd import utils as etcd_utils

from services import metrics, netaddr
from services.cluster import etcd_tls
from services.cluster.records import ClusterSnapshot, Keys

log = logging.getLogger(__name__)

# Errors that mean "etcd did not answer": retried, never fatal in loops.
UNREACHABLE = (
    aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, asyncio.TimeoutError, OSError,
)
ETCD_ERRORS = (aetcd.ClientError, grpc.RpcError, *UNREACHABLE)
# Reconnect quickly after an etcd restart; the gRPC default backs off to 120 s.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
}
# How long past the gRPC deadline (call_timeout_s) a call may take before it
# is abandoned: the gRPC deadline should fire first and give a proper error.
_DEADLINE_GRACE_S = 1.0
# close(): how long abandoned calls may take to end.
CLOSE_TASKS_S = 2.0
UNSET = object()
T = TypeVar("T")


class ClusterUnavailableError(ConnectionError):
    """etcd did not answer within the client's retry budget (or the client is closed)."""


class _WatchEnded(ConnectionError):
    """A watch stream ended or was cancelled by etcd: read again and re-watch."""


async def cancel_and_wait(tasks: collections.abc.Iterable[asyncio.Task | None], timeout_s: float = 5.0,
                          *, what: str = "tasks") -> bool:
    """Cancels the tasks and waits until all have ended, but for at most
    timeout_s. A task still running after a grace of a second is cancelled
    again every half second (a cancellation can be lost, see the module
    docstring). Returns False, logging the stragglers, if some still run."""
    loop = asyncio.get_running_loop()
    tasks = [t for t in tasks if t is not None]
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    wait_s = 1.0
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.error("%s still running %.1fs after being cancelled: %s", what, timeout_s,
                      ", ".join(t.get_name() for t in pending))
            return False
        _, pending = await asyncio.wait(pending, timeout=min(wait_s, remaining))
        wait_s = 0.5
    for task in tasks:  # their outcome is the caller's to inspect; never "never retrieved"
        if not task.cancelled():
            task.exception()
    return True


async def _on_stream(stream: grpc.aio.StreamStreamCall, operation: Awaitable[T]) -> T:
    """Awaits a read or write of stream. gRPC raises CancelledError when the
    call was cancelled under us (its channel closed): that is _WatchEnded,
    not a cancellation of this task, which is re-raised as is."""
    try:
        return await operation
    except asyncio.CancelledError:
        if stream.cancelled() and not asyncio.current_task().cancelling():
            raise _WatchEnded("watch stream cancelled (channel closed)") from None
        raise


def _checked_watch_response(response):
    """A WatchResponse; raises _WatchEnded if the stream ended or etcd cancelled the watch."""
    if response is grpc.aio.EOF:
        raise _WatchEnded("watch stream ended")
    if response.canceled or response.compact_revision:
        raise _WatchEnded(f"watch cancelled by etcd (compact revision {response.compact_revision}): "
                          f"{response.cancel_reason!r}")
    return response


def channel_target(endpoints: list[tuple[str, int]]) -> str:
    """The gRPC target of etcd's endpoints: host:port for one, else a static
    list of their addresses ("ipv4:10.0.0.1:2379,10.0.0.2:2379"); ValueError
    for a name that does not resolve or a mix of IPv4 and IPv6."""
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    addresses = []
    for host, port in endpoints:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError as error:
            raise ValueError(f"etcd endpoint {host}:{port} does not resolve: {error}") from None
        addresses.append((family, f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"))
    families = {family for family, _ in addresses}
    if len(families) > 1:
        raise ValueError(f"etcd endpoints mix IPv4 and IPv6 addresses: {endpoints}")
    scheme = "ipv6" if families == {socket.AF_INET6} else "ipv4"
    return f"{scheme}:" + ",".join(address for _, address in addresses)


async def check_reachable(endpoints: list[tuple[str, int]], timeout_s: float) -> None:
    """Returns once one endpoint accepts a TCP connection; ClusterUnavailableError
    naming each endpoint and its last error if none does within timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    errors: dict[str, str] = {}
    while True:
        for host, port in endpoints:
            attempt_s = max(0.05, min(1.0, deadline - loop.time()))
            try:
                async with asyncio.timeout(attempt_s):
                    _, writer = await asyncio.open_connection(host, port)
                writer.close()
                return
            except (OSError, TimeoutError) as error:
                errors[f"{host}:{port}"] = (error.strerror or repr(error)) if isinstance(error, OSError) \
                    else f"no answer in {attempt_s:.1f} s"
        if loop.time() >= deadline:
            detail = "; ".join(f"{e}: {why}" for e, why in errors.items())
            raise ClusterUnavailableError(f"etcd unreachable within {timeout_s:g} s ({detail}); check --etcd, "
                                          f"that etcd runs and that its port is open from this host")
        await asyncio.sleep(0.1)


class EtcdConnection:
    """One etcd channel with bounded calls, retries and change-only watches."""

    def __init__(self, endpoint: str, *, prefix: str = "/moemesh",
                 call_timeout_s: float = 2.0, retry_s: float = 10.0, reach_timeout_s: float = 10.0):
        try:
            self._endpoints = netaddr.split_endpoints(endpoint)
        except ValueError:
            raise ValueError(f"etcd endpoint must be host:port[,host:port...], got {endpoint!r}") from None
        self.endpoint = endpoint
        self.keys = Keys(prefix)
        self._etcd = etcd_tls.make_client(channel_target(self._endpoints), timeout=call_timeout_s,
                                          options=_CHANNEL_OPTIONS)
        self._call_timeout_s = call_timeout_s
        self._retry_s = retry_s
        self._reach_timeout_s = reach_timeout_s
        self._abandoned: set[asyncio.Task] = set()  # calls past their deadline, cancelled
        self._closed = False

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def connect(self, wait_s: float | None = 30.0) -> None:
        """Waits until etcd answers (None: forever); ClusterUnavailableError after
        wait_s, or after reach_timeout_s if no endpoint accepts a connection."""
        await check_reachable(self._endpoints, self._reach_timeout_s)
        await self._retry("connect", self._etcd.connect, budget_s=wait_s)
        await self._retry("connect", self._etcd.status, budget_s=wait_s)
        log.info("connected to etcd at %s", self.endpoint)

    async def revoke_lease(self, lease_id: int) -> None:
        """Revokes a lease (ours on close, or a dead leader's); absent leases are
        fine. One attempt, bounded by the call deadline; failures are logged."""
        try:
            await self._call("revoke_lease", self._etcd.revoke_lease, lease_id)
        except ETCD_ERRORS as error:
            log.warning("could not revoke lease %x: %r", lease_id, error)

    async def _close_channel(self) -> None:
        """Ends the abandoned calls and closes the channel, in bounded time."""
        await cancel_and_wait(list(self._abandoned), CLOSE_TASKS_S, what="abandoned etcd calls")
        try:
            await self._call("close", self._etcd.close)
        except ETCD_ERRORS as error:
            log.warning("closing the etcd client failed (%r); closing its channel", error)
            channel = self._etcd.channel
            if channel is not None:
                with contextlib.suppress(*ETCD_ERRORS):
                    await self._call("close", channel.close, 0)

    async def _call(self, what: str, fn: Callable[..., Awaitable[T]], *args,
                    timeout_s: float | None = None, **kwargs) -> T:
        """Awaits fn(*args, **kwargs), run as a task of its own, for at most
        timeout_s (default: the call deadline plus a grace). Past it the task is
        cancelled and abandoned and TimeoutError (etcd unreachable) is raised.
        If the caller is cancelled it is at once: whatever the callee does with
        its own cancellation cannot keep the caller waiting or swallow it."""
        if timeout_s is None:
            timeout_s = self._call_timeout_s + _DEADLINE_GRACE_S
        task = asyncio.get_running_loop().create_task(fn(*args, **kwargs), name=f"etcd-{what}")
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except BaseException:
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError(f"{what}: no answer within {timeout_s:.2f}s")
        if task.cancelled():  # not by us: e.g. its channel was closed under it
            raise TimeoutError(f"{what}: call cancelled")
        return task.result()

    def _abandon(self, task: asyncio.Task) -> None:
        """Cancels a call nobody waits for any more; close() waits for the stragglers."""
        task.cancel()
        if not task.done():
            self._abandoned.add(task)
            task.add_done_callback(self._forget_abandoned)

    def _forget_abandoned(self, task: asyncio.Task) -> None:
        self._abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("abandoned etcd call %s failed: %r", task.get_name(), task.exception())

    async def _retry(self, what: str, fn: Callable[..., Awaitable[T]], *args,
                     budget_s: float | None = UNSET, **kwargs) -> T:
        """Calls fn (each attempt under the call deadline), retrying while etcd
        is unreachable, for up to budget_s (None: until close())."""
        budget_s = self._retry_s if budget_s is UNSET else budget_s
        loop = asyncio.get_running_loop()
        deadline = None if budget_s is None else loop.time() + budget_s
        delay = 0.05
        while True:
            if self._closed:
                raise ClusterUnavailableError(f"etcd at {self.endpoint}: {what}: client closed")
            try:
                return await self._call(what, fn, *args, **kwargs)
            except UNREACHABLE as error:
                metrics.count_etcd_error(what)
                if self._closed or (deadline is not None and loop.time() + delay > deadline):
                    raise ClusterUnavailableError(f"etcd at {self.endpoint}: {what}: {error!r}") from error
                log.warning("etcd at %s unreachable (%s: %r); retrying in %.2fs",
                            self.endpoint, what, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _read_prefix(self, prefix: str) -> tuple[int, ClusterSnapshot]:
        result = await self._retry("read", self._etcd.get_prefix, prefix.encode())
        return result.header.revision, self.keys.parse(result.header.revision, result)

    async def _watch_state(self, watch_key: str, read: Callable[[], Awaitable[tuple[int, Any]]], *,
                           is_prefix: bool = True, key: Callable[[Any], Any] = lambda s: s,
                           from_events: Callable[[list], Any] | None = None) -> AsyncIterator[Any]:
        """Yields key(state) now and whenever it changes, state being read()
        again after each event on watch_key (or, given from_events, the state
        that the events of one response leave: one round trip less); survives
        etcd outages until close(), then ends. Closing it (or cancelling its
        consumer) cancels the watch at once."""
        watch_bytes = watch_key.encode()
        range_end = etcd_utils.prefix_range_end(watch_bytes) if is_prefix else b""
        last = UNSET
        delay = 0.05
        while not self._closed:
            stream = None
            try:
                revision, state = await read()
                if key(state) != last:
                    last = key(state)
                    yield last
                stream = await self._open_watch(watch_bytes, range_end, revision + 1)
                while True:
                    response = _checked_watch_response(await _on_stream(stream, stream.read()))
                    if not response.events:
                        continue  # a progress notification
                    state = from_events(response.events) if from_events else (await read())[1]
                    delay = 0.05
                    if key(state) != last:
                        last = key(state)
                        yield last
            except (*ETCD_ERRORS, ClusterUnavailableError) as error:
                if self._closed:
                    return
                metrics.count_etcd_error("watch")
                log.warning("watch on %s failed (%r); retrying in %.2fs", watch_key, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            finally:
                if stream is not None:
                    stream.cancel()  # synchronous: cannot block, even during cancellation

    async def _open_watch(self, key: bytes, range_end: bytes, start_revision: int) -> grpc.aio.StreamStreamCall:
        """A Watch stream of its own on [key, range_end) from start_revision,
        once etcd has confirmed it (within the call deadline)."""
        channel = self._etcd.channel
        if self._closed or channel is None:
            raise ClusterUnavailableError(f"etcd at {self.endpoint}: watch: client closed")
        stream = etcd_rpc.WatchStub(channel).Watch(metadata=self._etcd.metadata)
        create = etcd_rpc.WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision)
        try:
            async with asyncio.timeout(self._call_timeout_s):
                await _on_stream(stream, stream.write(etcd_rpc.WatchRequest(create_request=create)))
                response = _checked_watch_response(await _on_stream(stream, stream.read()))
            if not response.created:
                raise _WatchEnded(f"watch on {key!r}: expected a created response, got {response}")
        except asyncio.InvalidStateError as error:  # the stream finished before the write
            stream.cancel()
            raise _WatchEnded(f"watch on {key!r}: stream finished: {error}") from error
        except BaseException:
            stream.cancel()
            raise
        return stream
