"""The rank's reachability check before the collective (expert_svc/peers.py): a clear error,
quickly, naming the address that failed and the rank's own, instead of a hang in the rendezvous."""

import socket
import time

import pytest

from expert_svc import peers
from expert_svc.rendezvous import ProcessGroupLink, RendezvousError
from services.cluster import GroupAssignment, RankInfo


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.fixture
def listening():
    """Addresses of two listening sockets (the peers' gRPC servers)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    yield [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for sock in socks:
        sock.close()


def group(addresses: list[str], rendezvous: str) -> GroupAssignment:
    return GroupAssignment(group_id="g0", epoch=3, term=1, world_size=len(addresses), rendezvous_address=rendezvous,
                           ranks=[RankInfo(i, f"e{i}", a) for i, a in enumerate(addresses)], gateway_id="w0")


def test_reachable_peers_pass_and_a_rendezvous_not_open_yet_is_waited_for(listening):
    # Rank 0 opens its store only once its weights are loaded: refused there is not a failure.
    peers.check_peers(group(listening, f"127.0.0.1:{closed_port()}"), 1, listening[1])
    peers.check_peers(group(listening, listening[0]), 0, listening[0])


def test_a_peer_that_refuses_is_named_with_this_ranks_own_address(listening):
    dead = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(peers.PeerUnreachableError) as error:
        peers.check_peers(group([dead, listening[1]], dead), 1, listening[1])
    assert time.monotonic() - started < 2.0
    message = str(error.value)
    assert f"rank 1 of group 'g0' epoch 3 (advertised at {listening[1]}) cannot reach rank 0 (e0)'s gRPC " \
           f"address {dead}: Connection refused" in message
    assert "--advertise-host" in message


def test_a_wrong_own_advertised_address_is_named(listening):
    wrong = f"127.0.0.1:{closed_port()}"
    with pytest.raises(peers.PeerUnreachableError, match=f"cannot reach this rank's own advertised address {wrong}"):
        peers.check_peers(group([listening[0], wrong], listening[0]), 1, wrong)


def test_an_unanswered_rendezvous_address_is_an_error(listening, monkeypatch):
    def connect(address, timeout_s, attempts):
        return TimeoutError("timed out") if address == "10.9.9.9:29500" else None

    monkeypatch.setattr(peers, "_connect", connect)
    with pytest.raises(peers.PeerUnreachableError, match="cannot reach rank 0's rendezvous address "
                                                         "10.9.9.9:29500: timed out"):
        peers.check_peers(group(listening, "10.9.9.9:29500"), 1, listening[1])


def test_the_process_group_link_checks_before_the_rendezvous(listening):
    link = ProcessGroupLink("gloo", timeout_s=60)
    link.advertised_address = listening[1]
    dead = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=f"cannot reach rank 0 \\(e0\\)'s gRPC address {dead}"):
        link.connect(group([dead, listening[1]], dead), 1)
    assert time.monotonic() - started < 2.0  # not the 60 s collective timeout
    assert link.epoch is None
