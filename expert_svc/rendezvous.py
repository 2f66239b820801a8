"""The rank's torch.distributed process group: one per placement epoch of its group.

A re-formed group (docs/internals.md, "Rank failures") keeps its survivors'
processes, so a rank joins a new process group without restarting:
`ProcessGroupLink.connect` tears down the previous one and rendezvouses
again. The rendezvous goes through a TCPStore at the group's
`rendezvous_address` (rank 0's host and registered port), under a prefix of
the group id and epoch, so keys of an earlier epoch never mix with the new
ones (and the process group's name is reset before each attempt, see
`connect`). Rank 0 hosts the store and keeps it for as long as its rendezvous
address stays the same: a surviving rank 0 serves the next epoch's
rendezvous from the store it already holds, so its port is never bound
twice; the other ranks open a fresh client each epoch. If rank 0 cannot
host the store (another process took the port since it was registered),
`connect` raises `StorePortError`, so that the rank can register another
port for the next epoch (expert_svc/server.py).

`use_interface` points gloo and NCCL at one network interface (their
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME): without it gloo takes the address
the host name resolves to, which on many hosts is a loopback or management
address that the other hosts cannot reach.

A rank whose group moved on while its model thread waits in a collective on
a peer that hung (frozen, not dead: its sockets stay open, so nothing fails
before the collective timeout) must not wait that long: `sever` (from any
thread) shuts down the connections of the epoch's process group, and the
collective fails at once ("Connection closed by peer"). gloo's own
`abort()` and `shutdown()` leave a thread blocked in a collective blocked
(torch 2.13), so the link remembers which sockets the process group opened:
the connected TCP sockets that appeared while it was created, except those
of the rendezvous store (gloo's listening socket must stay: shutting it
down aborts the process).

`connect` and `close`: model thread only; every call blocks (up to the
collective timeout).
"""

import contextlib
import datetime
import logging
import os
import socket
import threading
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d

from expert_svc import peers
from services.cluster import GroupAssignment

log = logging.getLogger("expert_svc")


# The environment variables that pick the interface of gloo's and NCCL's sockets.
INTERFACE_ENV_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def use_interface(interface: str, *, override: bool) -> None:
    """Makes gloo and NCCL use `interface` (before any process group starts).
    override=False keeps a variable the operator has already set."""
    for name in INTERFACE_ENV_VARS:
        if override or not os.environ.get(name):
            os.environ[name] = interface
    log.info("collective network interface: %s", ", ".join(f"{n}={os.environ[n]}" for n in INTERFACE_ENV_VARS))


class RendezvousError(RuntimeError):
    """The ranks of an epoch did not all meet within the timeout (or the store failed)."""


class StorePortError(RendezvousError):
    """Rank 0 could not host the rendezvous store at its address (the port is taken)."""


class ProcessGroupLink:
    """This process's membership in its group's process group (gloo or NCCL)."""

    def __init__(self, backend: str, timeout_s: float):
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # This rank's registered gRPC address (set once registered): checked with
        # the peers' before each rendezvous (expert_svc/peers.py); empty: no check.
        self.advertised_address = ""
        self.epoch: int | None = None  # the epoch of the process group now up, None if none
        self._store: dist.TCPStore | None = None  # hosted while rank 0
        self._store_address: str | None = None
        self._lock = threading.Lock()  # sever() against close(): never shut a reused descriptor down
        self._pair_sockets: dict[int, str] = {}  # fd -> "socket:[inode]" of the process group's connections

    def connect(self, group: GroupAssignment, rank: int) -> dist.ProcessGroup:
        """Joins (group, epoch) as `rank`, after leaving any earlier process group;
        returns the new default process group. Raises RendezvousError."""
        self.close()
        # torch names the default process group by a per-process counter that only a
        # successful destroy_process_group() resets, and the name is part of gloo's
        # store keys: after a failed rendezvous the ranks would wait on different keys.
        distributed_c10d._world.group_count = 0
        if self.advertised_address:
            try:
                peers.check_peers(group, rank, self.advertised_address)
            except peers.PeerUnreachableError as error:
                raise RendezvousError(str(error)) from error
        try:
            store = self._rendezvous_store(group.rendezvous_address, rank)
            before = _sockets()
            dist.init_process_group(
                self.backend, store=dist.PrefixStore(f"{group.group_id}/{group.epoch}/", store),
                world_size=group.world_size, rank=rank, timeout=self.timeout)
            pairs = _connections_since(before, store_port=int(group.rendezvous_address.rsplit(":", 1)[1]))
        except (RuntimeError, OSError, TimeoutError) as error:  # DistStoreError, gloo connect errors
            kind = StorePortError if isinstance(error, StorePortError) else RendezvousError
            raise kind(f"rendezvous of group {group.group_id!r} epoch {group.epoch} at "
                       f"{group.rendezvous_address} failed: {error}") from error
        with self._lock:
            self._pair_sockets = pairs
            self.epoch = group.epoch
        return dist.group.WORLD

    def close(self, epoch: int | None = None) -> None:
        """Leaves the process group (only if it is `epoch`'s, when given)."""
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return
            if dist.is_initialized():
                dist.destroy_process_group()
            self.epoch = None
            self._pair_sockets = {}

    def sever(self, epoch: int | None = None) -> int:
        """Any thread: shuts down the connections of the process group now up (only
        if it is `epoch`'s, when given), so that a collective waiting on a hung peer
        fails at once; `close` still has to run. Returns how many it shut down."""
        num_severed = 0
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return 0
            for fd, inode in self._pair_sockets.items():
                if _socket_inode(fd) != inode:
                    continue  # already closed (the descriptor may be another socket's now)
                with contextlib.suppress(OSError):
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                    num_severed += 1
            self._pair_sockets = {}
        if num_severed:
            log.warning("severed %d connections of epoch %s's process group", num_severed, self.epoch)
        return num_severed

    def _rendezvous_store(self, address: str, rank: int) -> dist.Store:
        host, port = address.rsplit(":", 1)
        if rank != 0:
            _wait_listening(host, int(port), self.timeout.total_seconds())
            return dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        if self._store is None or self._store_address != address:
            self._store = None
            try:
                self._store = dist.TCPStore(host, int(port), is_master=True, timeout=self.timeout,
                                            wait_for_workers=False)
            except (RuntimeError, OSError) as error:  # DistNetworkError: EADDRINUSE
                raise StorePortError(str(error)) from error
            self._store_address = address
            log.info("hosting the rendezvous store at %s", address)
        return self._store


def _socket_inode(fd: int) -> str | None:
    """"socket:[inode]" if fd is a socket of this process, else None."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return link if link.startswith("socket:[") else None


def _sockets() -> dict[int, str]:
    """This process's sockets: fd -> "socket:[inode]" (empty where /proc is missing)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return {}
    return {fd: inode for fd in fds if (inode := _socket_inode(fd)) is not None}


def _connections_since(before: dict[int, str], store_port: int) -> dict[int, str]:
    """The connected TCP sockets opened since `before`, but the rendezvous store's."""
    pairs = {}
    for fd, inode in _sockets().items():
        if before.get(fd) == inode:
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            with sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                ports = (sock.getsockname()[1], sock.getpeername()[1])  # a listener raises: not a pair
            if store_port not in ports:
                pairs[fd] = inode
    return pairs


def _wait_listening(host: str, port: int, timeout_s: float, poll_s: float = 0.005) -> None:
    """Until something accepts connections at host:port (or timeout_s passed: the store's own
    connect then fails with its error). A new rank 0 (a standby taking a failed rank's place)
    binds its store only after its assignment reaches it and its experts are loaded; a
    TCPStore client that gets there first backs off for hundreds of milliseconds between
    attempts, and every stream of the group waits on that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(poll_s, 0.1)):
                return
        except OSError:
            time.sleep(poll_s)
