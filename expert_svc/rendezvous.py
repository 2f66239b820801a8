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
twice; the other ranks open a fresh client each epoch.

Model thread only: every call blocks (up to the collective timeout).

`use_interface` points gloo and NCCL at one network interface (their
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME): without it gloo takes the address
the host name resolves to, which on many hosts is a loopback or management
address that the other hosts cannot reach.
"""

import datetime
import logging
import os

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
            dist.init_process_group(
                self.backend, store=dist.PrefixStore(f"{group.group_id}/{group.epoch}/", store),
                world_size=group.world_size, rank=rank, timeout=self.timeout)
        except (RuntimeError, OSError, TimeoutError) as error:  # DistStoreError, gloo connect errors
            raise RendezvousError(f"rendezvous of group {group.group_id!r} epoch {group.epoch} at "
                                  f"{group.rendezvous_address} failed: {error}") from error
        self.epoch = group.epoch
        return dist.group.WORLD

    def close(self, epoch: int | None = None) -> None:
        """Leaves the process group (only if it is `epoch`'s, when given)."""
        if epoch is not None and epoch != self.epoch:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.epoch = None

    def _rendezvous_store(self, address: str, rank: int) -> dist.Store:
        host, port = address.rsplit(":", 1)
        if rank != 0:
            return dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        if self._store is None or self._store_address != address:
            self._store = None
            self._store = dist.TCPStore(host, int(port), is_master=True, timeout=self.timeout,
                                        wait_for_workers=False)
            self._store_address = address
            log.info("hosting the rendezvous store at %s", address)
        return self._store
