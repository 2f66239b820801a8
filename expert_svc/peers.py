"""Before the collective: can this rank reach its peers at the addresses they advertised?

A rank whose peers advertised an address it cannot route to (a loopback or
private address of another host, a firewall, the wrong interface) would
otherwise wait in the rendezvous until the collective timeout and then fail
with an error that names no address. `check_peers` connects (TCP, a short
timeout) to every rank's registered gRPC address, its own included (which
proves that the address it advertised reaches this process), and, on a rank
other than 0, to the rendezvous address; the first that fails raises
PeerUnreachableError naming that address, whose it is, and this rank's own
advertised address.

A refused connection to the rendezvous address is not a failure: rank 0
opens its store only once its weights are loaded, and a refusal proves the
host is reachable. Every other failure (timeout, no route, refused at a
gRPC address that is registered, so listening) is.

Blocking socket calls: runs on the model thread, before the process group.
"""

import socket

from services import netaddr
from services.cluster import GroupAssignment

# One TCP connect: a peer on a working network answers in well under this.
CONNECT_TIMEOUT_S = 2.0
# Attempts of each connect: a dropped SYN is retried by the kernel after 1 s.
ATTEMPTS = 2


class PeerUnreachableError(RuntimeError):
    """A peer's advertised address does not accept this rank's connection."""


def check_peers(group: GroupAssignment, rank: int, own_address: str, *,
                timeout_s: float = CONNECT_TIMEOUT_S, attempts: int = ATTEMPTS) -> None:
    """Raises PeerUnreachableError for the first address of the group this rank cannot reach."""
    for peer in group.ranks:
        whose = "this rank's own advertised address" if peer.rank == rank else \
            f"rank {peer.rank} ({peer.member_id})'s gRPC address"
        error = _connect(peer.address, timeout_s, attempts)
        if error is not None:
            raise PeerUnreachableError(_message(group, rank, own_address, peer.address, whose, error))
    if rank != 0:
        error = _connect(group.rendezvous_address, timeout_s, attempts)
        if error is not None and not isinstance(error, ConnectionRefusedError):
            raise PeerUnreachableError(_message(group, rank, own_address, group.rendezvous_address,
                                                "rank 0's rendezvous address", error))


def _message(group: GroupAssignment, rank: int, own_address: str, address: str, whose: str,
             error: OSError) -> str:
    reason = "timed out" if isinstance(error, TimeoutError) else (error.strerror or type(error).__name__)
    return (f"rank {rank} of group {group.group_id!r} epoch {group.epoch} (advertised at {own_address}) cannot "
            f"reach {whose} {address}: {reason}; every rank must reach every other at the address it "
            f"advertised (--advertise-host, --ep-interface; docs/deploy.md, \"Many hosts\")")


def _connect(address: str, timeout_s: float, attempts: int) -> OSError | None:
    """None if address accepts a TCP connection, else the last attempt's error."""
    host, port = netaddr.split_endpoint(address)
    error: OSError | None = None
    for _ in range(attempts):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return None
        except OSError as failure:  # TimeoutError is an OSError
            error = failure
            if isinstance(failure, ConnectionRefusedError):
                return error  # an answer: trying again changes nothing
    return error
