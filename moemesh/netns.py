"""Hosts on one machine: Linux network namespaces joined by a bridge, for the many-hosts test and bench.

    with netns.Network(["a", "b", "c"]) as net:  # raises netns.Unavailable where namespaces cannot be made
        net.address("a")                   # "10.213.97.1": host a's address on the private subnet
        proc = net.popen("a", cmd, log_path)   # a process inside host a's namespace
        net.set_link("b", up=False)         # partition host b from the others
        net.kill_host("c")                  # SIGKILL every process in c's namespace at once

Layout: one namespace per host plus a "switch" namespace holding the bridge.
Each host has a veth pair: `eth0` in its namespace (with the host's address
and `lo` up), the other end on the bridge. The root namespace, where the
test or the benchmark and its clients run, gets one more veth onto the
bridge with the subnet's .254 address: the clients' machine. So nothing
goes through the root namespace's bridge or firewall rules, and every
address the mesh uses is on the private subnet. Taking a host's bridge-side
end down is a partition: the host keeps its interface, address and routes,
and its packets go nowhere (a failed cable or switch port), so peers learn
of it only through their timeouts, as across real machines.

The subnet is MOEMESH_NETNS_SUBNET's /24 (default 10.213.97.0/24; hosts .1,
.2, ...). Names carry the creating pid, so parallel runs do not clash;
namespaces left by a run that died (its pid gone) are removed at the next
start. stop() (also at exit, and by the context manager whatever happens)
kills every process in each namespace (`ip netns pids`) and deletes the
namespaces, which takes their veths along. Root and iproute2 are required.
"""

import atexit
import contextlib
import ipaddress
import itertools
import os
import pathlib
import shutil
import signal
import subprocess

PREFIX = "mmns"
DEFAULT_SUBNET = "10.213.97.0/24"
INTERFACE = "eth0"  # each host's interface, in its own namespace (GLOO_SOCKET_IFNAME)
_networks = itertools.count()  # several networks of one process get distinct names


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a container without the right)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


class Network:
    """Hosts (namespaces) on one bridge; `start`/`stop` or a context manager."""

    def __init__(self, hosts: list[str], subnet: str = ""):
        if len(set(hosts)) != len(hosts) or not all(h.isalnum() and len(h) <= 4 for h in hosts):
            raise ValueError(f"hosts must be distinct short alphanumeric names, got {hosts}")
        self.subnet = ipaddress.ip_network(subnet or os.environ.get("MOEMESH_NETNS_SUBNET", DEFAULT_SUBNET))
        if self.subnet.prefixlen != 24 or self.subnet.version != 4:
            raise ValueError(f"the subnet must be an IPv4 /24, got {self.subnet}")
        self.hosts = list(hosts)
        self.tag = f"{PREFIX}{os.getpid()}-{next(_networks) % 10}"
        self.switch = f"{self.tag}sw"
        self._client_link = f"{self.tag}c"  # the root namespace's end (interface names: 15 chars at most)
        self._started = False
        # host -> the processes popen started there: killed with the namespace's, since one that
        # has not entered the namespace yet (`ip netns exec` still setting up) is not listed in it
        self._procs: dict[str, list[subprocess.Popen]] = {host: [] for host in hosts}

    def namespace(self, host: str) -> str:
        return f"{self.tag}{host}"

    def address(self, host: str) -> str:
        """The host's address on the subnet."""
        return str(self.subnet.network_address + 1 + self.hosts.index(host))

    @property
    def client_address(self) -> str:
        """The root namespace's address on the subnet (where the clients run)."""
        return str(self.subnet.network_address + 254)

    def start(self) -> "Network":
        check_available()
        remove_stale()
        if _ip("route", "show", str(self.subnet)).stdout.strip():
            raise RuntimeError(f"{self.subnet} is routed on this machine already; "
                               f"set MOEMESH_NETNS_SUBNET to a free /24")
        atexit.register(self.stop)
        self._started = True
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        plen = self.subnet.prefixlen
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "name", f"v{host}", "type", "veth", "peer", "name", INTERFACE,
                "netns", ns)
            _ip("-n", self.switch, "link", "set", f"v{host}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/{plen}", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
        _ip("-n", self.switch, "link", "add", "name", "client", "type", "veth", "peer", "name", self._client_link,
            "netns", "1")
        _ip("-n", self.switch, "link", "set", "client", "master", "br0", "up")
        _ip("addr", "add", f"{self.client_address}/{plen}", "dev", self._client_link)
        _ip("link", "set", self._client_link, "up")

    def popen(self, host: str, cmd: list[str], log_path: pathlib.Path, env: dict | None = None) -> subprocess.Popen:
        """Starts cmd inside the host's namespace (`ip netns exec` execs it: the pid is the command's)."""
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *cmd], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        self._procs[host] = [p for p in self._procs[host] if p.poll() is None] + [proc]
        return proc

    def pids(self, host: str) -> list[int]:
        """Every process in the host's namespace."""
        result = _ip("netns", "pids", self.namespace(host), check=False)
        return [int(p) for p in result.stdout.split()]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILLs every process in the host's namespace at once (a host lost); returns their pids."""
        pids = sorted(set(self.pids(host)) | {p.pid for p in self._procs[host] if p.poll() is None})
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def set_link(self, host: str, *, up: bool) -> None:
        """Connects the host to the bridge, or cuts it off (its bridge-side end down)."""
        _ip("-n", self.switch, "link", "set", f"v{host}", "up" if up else "down")

    def stop(self) -> None:
        """Kills every process in the namespaces and deletes them (with their veths); idempotent."""
        if not self._started:
            return
        self._started = False
        for host in self.hosts:
            self.kill_host(host)
        for ns in [*map(self.namespace, self.hosts), self.switch]:
            _ip("netns", "delete", ns, check=False)
        _ip("link", "delete", self._client_link, check=False)  # gone with the switch; in case it was not
        atexit.unregister(self.stop)

    def __enter__(self) -> "Network":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def check_available() -> None:
    """Raises Unavailable, saying why, unless namespaces can be made here."""
    if shutil.which("ip") is None:
        raise Unavailable("no `ip` command (iproute2)")
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise Unavailable(f"cannot make a network namespace: {made.stderr.strip()}")
    try:
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            raise Unavailable(f"cannot make a bridge in a namespace: {bridge.stderr.strip()}")
    finally:
        _ip("netns", "delete", probe, check=False)


def remove_stale() -> None:
    """Deletes the namespaces of earlier runs whose process is gone (killed before their cleanup)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name.removeprefix(PREFIX).split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
            _kill_namespace(name)
            _ip("netns", "delete", name, check=False)


def _kill_namespace(ns: str) -> None:
    result = _ip("netns", "pids", ns, check=False)
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
