"""A mesh spread over hosts of a moemesh.netns.Network: the many-hosts test's and bench's mesh.

    with netns.Network(["a", "b", "c"]) as net, multihost.HostMesh(net, spec) as mesh:
        mesh.gateway_address       # "10.213.97.1:PORT", reachable from the root namespace
        mesh.restart("expert-c")   # a role again, on its host, with its first command

Host `spec.control_host` runs etcd (client URL on its subnet address), the
three schedulers, the router and the gateway; each entry of `spec.ranks`
(member id -> host) one expert service of the group, which forms from those
alone; `spec.standbys` start once the gateway serves, so the scheduler never
puts one into the first group. Every role binds and advertises its host's
address on the subnet (--bind-host, --advertise-host), and the expert
services' gloo uses the host's interface (--ep-interface), so every byte
between roles crosses the bridge. Like moemesh.launcher, each process writes its bound port to a
file that this waits for; logs and port files go to spec.work_dir.
"""

import contextlib
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh import etcd, netns
from moemesh.launcher import DEFAULT_DATA_PLANE_NICE, NUM_SCHEDULERS, Role, tail

ETCD_CLIENT_PORT = 2379  # fixed: each host has its own network namespace, so its ports are its own


@dataclasses.dataclass(frozen=True, slots=True)
class HostMeshSpec:
    """What runs where."""

    model_dir: str
    work_dir: str
    ranks: dict[str, str]  # expert member id -> host, in rank order
    standbys: dict[str, str] = dataclasses.field(default_factory=dict)  # member id -> host
    control_host: str = "a"
    extra_args: dict = dataclasses.field(default_factory=dict)  # role module's package -> flags
    ready_timeout_s: float = 240.0


@dataclasses.dataclass(slots=True)
class HostedRole:
    """A role process and the host it runs on."""

    host: str
    role: Role

    @property
    def proc(self) -> subprocess.Popen:
        return self.role.proc


class HostMesh:
    """The running mesh; `start`/`stop` or a context manager (stop leaves the namespaces to the Network)."""

    def __init__(self, net: netns.Network, spec: HostMeshSpec):
        self.net, self.spec = net, spec
        self.work_dir = pathlib.Path(spec.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.roles: dict[str, HostedRole] = {}
        self.etcd_proc: subprocess.Popen | None = None
        self.etcd_endpoint = f"{net.address(spec.control_host)}:{ETCD_CLIENT_PORT}"

    @property
    def gateway_address(self) -> str:
        return self.address("gateway")

    def address(self, name: str) -> str:
        hosted = self.roles[name]
        return f"{self.net.address(hosted.host)}:{hosted.role.port}"

    def start(self) -> "HostMesh":
        try:
            self._start_etcd()
            control, common = self.spec.control_host, ["--etcd", self.etcd_endpoint]
            for i in range(NUM_SCHEDULERS):
                self._spawn(control, f"scheduler-{i}", "scheduler_svc.main",
                            [*common, "--member-id", f"scheduler-{i}", "--group-size", str(len(self.spec.ranks))])
            self._spawn(control, "router", "router_svc.main", [*common, "--member-id", "router-0"])
            for member_id, host in self.spec.ranks.items():
                self._spawn_expert(member_id, host)
            self._spawn(control, "gateway", "gateway.main",
                        [*common, "--member-id", "gateway-0", "--model", self.spec.model_dir, "--http-port", "-1"])
            for name in self.roles:
                self._wait_port(name)
            self.wait_serving(self.spec.ready_timeout_s)
            for member_id, host in self.spec.standbys.items():
                self._spawn_expert(member_id, host)
                self._wait_port(member_id)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        host = self.spec.control_host
        client_url = f"http://{self.net.address(host)}:{ETCD_CLIENT_PORT}"
        peer_url = "http://127.0.0.1:2380"  # one member: its peer URL stays on the host's loopback
        cmd = [etcd.etcd_binary(), "--name=moemesh", f"--data-dir={self.work_dir / 'etcd'}",
               f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
               f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
               f"--initial-cluster=moemesh={peer_url}", "--heartbeat-interval=100", "--election-timeout=500"]
        log_path = self.work_dir / "etcd.log"
        self.etcd_proc = self.net.popen(host, cmd, log_path)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.etcd_proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.etcd_proc.returncode}; log:\n{tail(log_path)}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{client_url}/health", timeout=1) as response:
                    if b'"health":"true"' in response.read():
                        return
            time.sleep(0.1)
        raise TimeoutError(f"etcd at {client_url} not healthy in 30 s; log:\n{tail(log_path)}")

    def _spawn_expert(self, member_id: str, host: str) -> None:
        self._spawn(host, member_id, "expert_svc.main",
                    ["--etcd", self.etcd_endpoint, "--member-id", member_id, "--model", self.spec.model_dir,
                     "--device", "cpu", "--ep-interface", netns.INTERFACE])  # gloo on the host's interface

    def _spawn(self, host: str, name: str, module: str, args: list[str]) -> None:
        port_file = self.work_dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        key = module.split(".")[0]
        address = self.net.address(host)
        cmd = [sys.executable, "-m", module, *args, "--bind-host", address, "--advertise-host", address, "--port", "0",
               "--port-file", str(port_file), "--metrics-port", "0", *self.spec.extra_args.get(key, [])]
        if key != "scheduler_svc" and shutil.which("nice"):  # the control plane first, as moemesh.launcher
            cmd = ["nice", "-n", str(DEFAULT_DATA_PLANE_NICE), *cmd]
        role = Role(name=name, proc=None, port_file=port_file, log_path=self.work_dir / f"{name}.log", cmd=cmd)
        self.roles[name] = HostedRole(host, role)
        self._launch(name)

    def _launch(self, name: str) -> None:
        hosted = self.roles[name]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        hosted.role.proc = self.net.popen(hosted.host, hosted.role.cmd, hosted.role.log_path, env)

    def _wait_port(self, name: str) -> int:
        role = self.roles[name].role
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            if role.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {role.proc.returncode}; log:\n{tail(role.log_path)}")
            with contextlib.suppress(FileNotFoundError, ValueError):
                role.port = int(role.port_file.read_text())
                return role.port
            time.sleep(0.05)
        raise TimeoutError(f"{name} wrote no port in {self.spec.ready_timeout_s} s; log:\n{tail(role.log_path)}")

    def wait_serving(self, timeout_s: float) -> None:
        """Returns once the gateway answers SERVING (its group is formed and ready)."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.gateway_address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                for name, hosted in self.roles.items():
                    if hosted.proc.poll() is not None:
                        raise RuntimeError(f"{name} exited with {hosted.proc.returncode}; "
                                           f"log:\n{tail(hosted.role.log_path)}")
                with contextlib.suppress(grpc.RpcError):
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.1)
        raise TimeoutError(f"the gateway was not SERVING after {timeout_s} s; log:\n"
                           f"{tail(self.roles['gateway'].role.log_path)}")

    def restart(self, name: str) -> Role:
        """Starts role `name` again on its host with its first command (SIGKILLing it first if it runs);
        returns it once it wrote its port. Its log goes on in the same file."""
        hosted = self.roles[name]
        if hosted.proc.poll() is None:
            hosted.proc.kill()
        hosted.proc.wait()
        hosted.role.port_file.unlink(missing_ok=True)
        self._launch(name)
        self._wait_port(name)
        return hosted.role

    def on_host(self, host: str) -> list[str]:
        """The names of the roles started on host."""
        return [name for name, hosted in self.roles.items() if hosted.host == host]

    def stop(self) -> None:
        """SIGTERM to every role (gateway first), then to etcd (the roles leave through it), SIGKILL
        after a grace; waits for them."""
        _terminate([h.proc for h in reversed(self.roles.values()) if h.proc is not None])
        _terminate([self.etcd_proc] if self.etcd_proc is not None else [])

    def __enter__(self) -> "HostMesh":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _terminate(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
