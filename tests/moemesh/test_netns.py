"""moemesh/netns.py: hosts reach each other over the bridge, a host's link down cuts it off and back
up reconnects it, killing a host kills every process in it, and whatever happens in the block the
namespaces, links and processes are gone after it (skipped where namespaces cannot be made)."""

import pathlib
import socket
import subprocess
import sys
import time

import pytest

from moemesh import netns

SERVER = ("import socket, sys\ns = socket.create_server((sys.argv[1], 5000))\n"
          "while True:\n    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n")
CLIENT = "import socket, sys\nprint(socket.create_connection((sys.argv[1], 5000), timeout=1).recv(2))\n"


@pytest.fixture(autouse=True)
def available():
    try:
        netns.check_available()
    except netns.Unavailable as why:
        pytest.skip(f"network namespaces cannot be made here: {why}")


def _names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_hosts_talk_over_the_bridge_a_cut_link_isolates_and_everything_is_removed_after(tmp_path):
    log = tmp_path / "log"
    net = netns.Network(["x", "y"], subnet="10.213.98.0/24")
    with pytest.raises(RuntimeError, match="the block failed"), net:
        server = net.popen("y", [sys.executable, "-c", SERVER, net.address("y")], log)
        assert _eventually(lambda: _connects(net, "x", net.address("y")))
        with socket.create_connection((net.address("y"), 5000), timeout=5) as sock:  # from the root namespace
            assert sock.recv(2) == b"hi"
        net.set_link("x", up=False)
        assert not _connects(net, "x", net.address("y"))
        net.set_link("x", up=True)
        assert _eventually(lambda: _connects(net, "x", net.address("y")))
        assert net.pids("y") == [server.pid]
        sleeper = net.popen("x", ["sleep", "600"], log)
        raise RuntimeError("the block failed")  # cleanup must happen anyway
    assert sleeper.wait(10) == -9 and server.wait(10) == -9
    assert net.tag not in _names()


def test_kill_host_kills_every_process_in_it_at_once(tmp_path):
    with netns.Network(["x", "y"], subnet="10.213.98.0/24") as net:
        procs = [net.popen("x", ["sleep", "600"], tmp_path / "log") for _ in range(3)]
        other = net.popen("y", ["sleep", "600"], tmp_path / "log")
        assert _eventually(lambda: len(net.pids("x")) == 3)
        assert sorted(net.kill_host("x")) == sorted(p.pid for p in procs)
        assert [p.wait(10) for p in procs] == [-9] * 3 and other.poll() is None


def test_a_subnet_already_routed_is_refused():
    with netns.Network(["x"], subnet="10.213.98.0/24") as net:
        with pytest.raises(RuntimeError, match="MOEMESH_NETNS_SUBNET"):
            netns.Network(["z"], subnet=str(net.subnet)).start()
    assert net.tag not in _names()


def _connects(net: netns.Network, host: str, address: str) -> bool:
    client = net.popen(host, [sys.executable, "-c", CLIENT, address], pathlib.Path("/dev/null"))
    return client.wait(30) == 0


def _eventually(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
