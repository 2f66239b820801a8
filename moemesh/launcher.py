"""Starts a whole mesh on this machine: etcd, three schedulers, the router,
N expert services and the gateway, each its own process; or some of these
roles (`MeshSpec.roles`, `moemesh up --roles`), the others running on other
hosts that share the etcd (docs/deploy.md, "Many hosts").

Used by `moemesh up` and by the end-to-end tests, so both start the mesh the
same way. Every process binds port 0 (or the port asked for) and writes the
bound port to a file that the launcher waits for.

With `MeshSpec.tls` (`moemesh up --tls`) it first makes a throwaway CA and a
certificate per role in the work directory (services/certs.py), starts etcd
with client-certificate authentication and its users and roles
(services/cluster/etcd_tls.py), and passes every role its `--tls-dir`.
"""

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh import etcd, supervisor
from services import tls
from services.process import http_port_file, metrics_port_file, read_port_file

log = logging.getLogger(__name__)

NUM_SCHEDULERS = 3
# The roles `moemesh up` can start; MeshSpec.roles' default is all of them.
ALL_ROLES = ("etcd", "scheduler", "router", "expert", "gateway")

# MeshSpec.data_plane_nice's default (`moemesh up --data-plane-nice`).
DEFAULT_DATA_PLANE_NICE = 5


@dataclasses.dataclass(frozen=True, slots=True)
class MeshSpec:
    """What to start."""

    model_dir: str
    num_ranks: int = 1
    # Expert services beyond the group's ranks: standbys that replace a failed rank.
    num_standby: int = 0
    device: str = "cpu"
    # Gateway port; 0 picks a free one.
    gateway_port: int = 0
    # Port of the serving gateway's OpenAI-compatible HTTP endpoint; 0 picks a
    # free one, -1 turns it off (standby gateways always pick a free one).
    http_port: int = 0
    # Gateways started: the first serves the group, the others stand by (the
    # scheduler leader gives one the group when its gateway leaves).
    num_gateways: int = 1
    # An existing etcd (host:port); empty starts a private one.
    etcd: str = ""
    # Where logs, port files and etcd's data go; empty makes a temporary dir.
    work_dir: str = ""
    # Client API keys of every gateway (--api-keys; docs/security.md); empty: none needed.
    api_keys: str = ""
    # Extra flags per role, e.g. {"expert_svc": ["--kv-blocks", "64"]}.
    extra_args: dict = dataclasses.field(default_factory=dict)
    # Extra environment variables of every process, e.g. the OTEL_* of tracing.
    env: dict = dataclasses.field(default_factory=dict)
    ready_timeout_s: float = 180.0
    # Niceness added to the data plane (router, expert services, gateways): on a shared host
    # the control plane (etcd, schedulers) gets the CPU first, so that lease keepalives,
    # leader probes and a handover never queue behind a model step or a burst of streams.
    # 0: every process at the launcher's priority.
    data_plane_nice: int = DEFAULT_DATA_PLANE_NICE
    # Mutual TLS between every role and etcd, with a throwaway CA in the work dir.
    tls: bool = False
    # The expert services' --num-spare-expert-slots: "auto" sizes the slots for expert replicas
    # from memory (0 on one rank; expert_svc/spare_slots.py), or a count. extra_args may override it.
    num_spare_expert_slots: str = "auto"
    # The roles started here (ALL_ROLES' names); the others run elsewhere on the same
    # etcd. "etcd" is dropped when `etcd` is given (that one is used).
    roles: tuple[str, ...] = ALL_ROLES
    # Every role's --bind-host (and the etcd started here listens on it); empty: the roles' default.
    bind_host: str = ""
    # Every role's --advertise-host; empty: the roles' default (services/settings.py).
    advertise_host: str = ""
    # The expert services' --ep-interface: the network interface of the collective.
    ep_interface: str = ""
    # Appended to every member id (expert-<tag>-0, ...), so that the roles of several
    # hosts differ in etcd; empty: none (the whole mesh on one host).
    member_tag: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.roles) - set(ALL_ROLES))
        if unknown or not self.roles:
            raise ValueError(f"--roles must be a non-empty list of {','.join(ALL_ROLES)}, got {','.join(self.roles)!r}")
        if self.etcd and "etcd" in self.roles and set(self.roles) != set(ALL_ROLES):
            raise ValueError(f"--roles includes etcd but --etcd {self.etcd} is given: drop one")
        if not self.etcd and "etcd" not in self.roles:
            raise ValueError("without etcd in --roles, give --etcd HOST:PORT (the etcd of the other hosts)")
        if self.tls and set(self.roles) != set(ALL_ROLES):
            raise ValueError("--tls makes a throwaway CA for one host's mesh; with --roles, give every role "
                             "--tls-dir certificates of one CA instead (docs/security.md)")
        if self.tls and self.etcd:
            raise ValueError("--tls starts its own etcd (an existing one does not trust the throwaway CA); "
                             "drop --etcd or --tls")
        if self.num_ranks < 1:
            raise ValueError(f"--ranks must be at least 1, got {self.num_ranks}")
        if self.num_standby < 0:
            raise ValueError(f"num_standby must be >= 0, got {self.num_standby}")
        if self.num_gateways < 1:
            raise ValueError(f"num_gateways must be at least 1, got {self.num_gateways}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in -1..65535 (-1: off), got {self.http_port}")
        if not 0 <= self.data_plane_nice <= 19:
            raise ValueError(f"data_plane_nice must be within 0..19, got {self.data_plane_nice}")
        if self.num_spare_expert_slots != "auto" and not self.num_spare_expert_slots.isdigit():
            raise ValueError(f"--num-spare-expert-slots must be 'auto' or a count >= 0, "
                             f"got {self.num_spare_expert_slots!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if not (pathlib.Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"--model {self.model_dir!r} has no config.json")
        from services.model.config import ModelConfig  # torch: only once a mesh is started

        num_experts = ModelConfig.from_model_dir(self.model_dir).num_experts
        # --ranks is the group size where the schedulers start; elsewhere the expert services started
        # here, a part of a group (the scheduler leader refuses a size that does not divide the experts).
        if "scheduler" in self.roles and num_experts % self.num_ranks:
            divisors = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
            raise ValueError(f"--ranks {self.num_ranks} does not divide the {num_experts} experts of "
                             f"{self.model_dir!r} (each rank holds experts/ranks of them); use one of {divisors}")


@dataclasses.dataclass(slots=True)
class Role:
    """One started process."""

    name: str
    proc: subprocess.Popen
    port_file: pathlib.Path
    log_path: pathlib.Path
    port: int = 0
    cmd: list[str] = dataclasses.field(default_factory=list)  # what started it (restart() reuses it)

    @property
    def member_id(self) -> str:
        """The member id it was started with (`--member-id` of its command), else its name."""
        return self.cmd[self.cmd.index("--member-id") + 1] if "--member-id" in self.cmd else self.name

    @property
    def metrics_port(self) -> int | None:
        """The port of its /metrics, /healthz and /readyz (None until written)."""
        return read_port_file(metrics_port_file(str(self.port_file)))

    @property
    def http_port(self) -> int | None:
        """A gateway's OpenAI-compatible HTTP port (None until written, or when off)."""
        return read_port_file(http_port_file(str(self.port_file)))


class Mesh:
    """A running mesh; use as a context manager or call start()/stop()."""

    def __init__(self, spec: MeshSpec):
        self.spec = spec
        self.roles: list[Role] = []
        self.etcd: etcd.EtcdProcess | None = None
        self.etcd_endpoint = spec.etcd
        self._tmp = None if spec.work_dir else tempfile.TemporaryDirectory(prefix="moemesh-")
        self.work_dir = pathlib.Path(spec.work_dir or self._tmp.name)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._restarts: dict[str, list[float]] = {}  # role name -> monotonic times of its restarts
        # name (a role of tls.ROLES, "etcd", "root") -> its certificate directory, with spec.tls
        self.tls_dirs: dict[str, pathlib.Path] = {}
        self.supervisor: supervisor.Supervisor | None = None  # started by the first restart_exited

    @property
    def gateway(self) -> Role:
        return next(r for r in self.roles if r.name == "gateway")

    @property
    def dial_host(self) -> str:
        """The host this machine's clients dial the roles started here at."""
        spec = self.spec
        if spec.advertise_host:
            return spec.advertise_host
        return spec.bind_host if spec.bind_host and spec.bind_host not in ("0.0.0.0", "::") else "127.0.0.1"

    @property
    def gateway_address(self) -> str:
        return f"{self.dial_host}:{self.gateway.port}"

    @property
    def gateway_addresses(self) -> list[str]:
        """Every gateway's address, the serving one (gateway-0 at start) first."""
        return [f"{self.dial_host}:{r.port}" for r in self.roles if r.name.startswith("gateway")]

    @property
    def http_url(self) -> str | None:
        """The base URL of the serving gateway's OpenAI-compatible endpoint (None when off)."""
        port = self.gateway.http_port
        return None if port is None else f"http://{self.dial_host}:{port}/v1"

    @property
    def scheduler_addresses(self) -> list[str]:
        return [f"{self.dial_host}:{r.port}" for r in self.roles if r.name.startswith("scheduler")]

    @property
    def has_gateway(self) -> bool:
        return "gateway" in self.spec.roles

    def start(self) -> "Mesh":
        """Starts every process and returns once the gateway serves (without a
        gateway here: once every role has registered its port)."""
        try:
            self._start_all()
            if self.has_gateway:
                self._wait_serving(self.gateway_address, self.spec.ready_timeout_s)
                if self.spec.http_port >= 0:
                    self._wait_file(self.gateway, pathlib.Path(http_port_file(str(self.gateway.port_file))))
                self._start_standby_gateways()
        except BaseException:
            self.stop()
            raise
        self._write_state()
        return self

    def tls_files(self, role: str) -> tls.TlsFiles | None:
        """The certificate files of role (None without TLS)."""
        return tls.TlsFiles.from_dir(self.tls_dirs[role]) if self.tls_dirs else None

    def _start_etcd(self) -> None:
        if self.spec.tls:
            from services import certs  # cryptography: only for a TLS mesh
            from services.cluster import etcd_tls

            self.tls_dirs = certs.make_local_pki(self.work_dir / "tls")
            self.etcd = etcd.start_etcd(self.work_dir / "etcd", tls_dir=self.tls_dirs["etcd"])
            etcd_tls.enable_auth(self.etcd.endpoint, self.tls_files(certs.ETCD_ROOT))
        else:
            # With roles on other hosts, they reach it at this host's address.
            spread = self.spec.bind_host or self.spec.advertise_host
            hosts = {"listen_host": self.spec.bind_host or "0.0.0.0", "advertise_host": self.dial_host} if spread else {}
            self.etcd = etcd.start_etcd(self.work_dir / "etcd", **hosts)
        self.etcd_endpoint = self.etcd.endpoint

    def _member_id(self, name: str) -> str:
        """The member id of role `name` ("expert-0"): with a member tag, "expert-<tag>-0"."""
        base, _, index = name.rpartition("-")
        return f"{base}-{self.spec.member_tag}-{index}" if self.spec.member_tag else name

    def _common_args(self) -> list[str]:
        """The flags every role gets: etcd and the addresses of this host."""
        spec = self.spec
        args = ["--etcd", self.etcd_endpoint]
        if spec.bind_host:
            args += ["--bind-host", spec.bind_host]
        if spec.advertise_host:
            args += ["--advertise-host", spec.advertise_host]
        return args

    def _start_all(self) -> None:
        roles = self.spec.roles
        if not self.etcd_endpoint:
            self._start_etcd()
        common = self._common_args()
        for i in range(NUM_SCHEDULERS if "scheduler" in roles else 0):
            self._spawn(f"scheduler-{i}", "scheduler_svc.main",
                        [*common, "--member-id", self._member_id(f"scheduler-{i}"),
                         "--group-size", str(self.spec.num_ranks)])
        if "router" in roles:
            self._spawn("router", "router_svc.main", [*common, "--member-id", self._member_id("router-0")])
        ep_interface = collective_interface_args(self.spec)
        for r in range(self.spec.num_ranks + self.spec.num_standby if "expert" in roles else 0):
            self._spawn(f"expert-{r}", "expert_svc.main",
                        [*common, "--member-id", self._member_id(f"expert-{r}"), "--model", self.spec.model_dir,
                         "--device", rank_device(self.spec.device, r),
                         "--num-spare-expert-slots", self.spec.num_spare_expert_slots, *ep_interface])
        if self.has_gateway:
            self._spawn("gateway", "gateway.main",
                        [*common, "--member-id", self._member_id("gateway-0"), "--model", self.spec.model_dir,
                         "--http-port", str(self.spec.http_port)],
                        port=self.spec.gateway_port)
        for role in self.roles:
            role.port = self._wait_port(role, self.spec.ready_timeout_s)

    def _start_standby_gateways(self) -> None:
        """Gateways 1.. once gateway-0 serves the group: registered, without a
        group until the scheduler leader gives them one (its gateway left)."""
        for i in range(1, self.spec.num_gateways):
            self._spawn(f"gateway-{i}", "gateway.main", [*self._common_args(), "--member-id",
                                                         self._member_id(f"gateway-{i}"), "--model", self.spec.model_dir,
                                                         "--http-port", "0" if self.spec.http_port >= 0 else "-1"])
            self.roles[-1].port = self._wait_port(self.roles[-1], self.spec.ready_timeout_s)

    def _spawn(self, name: str, module: str, args: list[str], port: int = 0) -> None:
        port_file = self.work_dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log_path = self.work_dir / f"{name}.log"
        role_key = module.split(".")[0]
        tls_args = ["--tls-dir", str(self.tls_dirs[role_key.removesuffix("_svc")])] if self.tls_dirs else []
        cmd = [sys.executable, "-m", module, *args, "--port", str(port), "--port-file", str(port_file),
               "--metrics-port", "0", *tls_args, *self.spec.extra_args.get(role_key, [])]
        if role_key == "gateway" and self.spec.api_keys:
            cmd += ["--api-keys", str(pathlib.Path(self.spec.api_keys).resolve())]
        if role_key != "scheduler_svc" and self.spec.data_plane_nice and shutil.which("nice"):
            cmd = ["nice", "-n", str(self.spec.data_plane_nice), *cmd]  # set before exec: every thread has it
        self.roles.append(self._launch(name, cmd, port_file, log_path))

    def _launch(self, name: str, cmd: list[str], port_file: pathlib.Path, log_path: pathlib.Path) -> Role:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return Role(name=name, proc=proc, port_file=port_file, log_path=log_path, cmd=cmd)

    def restart(self, name: str) -> Role:
        """Starts the role `name` again with the command it was first started
        with (SIGKILLing it first if it still runs, even stopped); returns the
        new Role once it reported its port. Its log goes on in the same file."""
        index = next(i for i, r in enumerate(self.roles) if r.name == name)
        old = self.roles[index]
        if old.proc.poll() is None:
            os.killpg(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        for stale in (old.port_file, pathlib.Path(metrics_port_file(str(old.port_file))),
                      pathlib.Path(http_port_file(str(old.port_file)))):
            stale.unlink(missing_ok=True)
        role = self.roles[index] = self._launch(name, old.cmd, old.port_file, old.log_path)
        role.port = self._wait_port(role, self.spec.ready_timeout_s)
        self._write_state()
        return role

    def _wait_port(self, role: Role, timeout_s: float) -> int:
        return self._wait_file(role, role.port_file, timeout_s)

    def _wait_file(self, role: Role, port_file: pathlib.Path, timeout_s: float | None = None) -> int:
        """The port role writes to port_file, once it is there."""
        timeout_s = self.spec.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if role.proc.poll() is not None:
                raise RuntimeError(f"{role.name} exited with {role.proc.returncode}; log:\n{tail(role.log_path)}")
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(port_file.read_text())
            time.sleep(0.05)
        raise TimeoutError(f"{role.name} did not write {port_file.name} in {timeout_s} s; "
                           f"log:\n{tail(role.log_path)}")

    def _wait_serving(self, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.operator_channel(address, "gateway") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                self.check_alive()
                with contextlib.suppress(grpc.RpcError):
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.1)
        raise TimeoutError(f"gateway at {address} not SERVING after {timeout_s} s; log:\n{tail(self.gateway.log_path)}")

    def operator_channel(self, address: str, peer_role: str) -> grpc.Channel:
        """A blocking channel to a role, as the operator (with TLS: its certificate)."""
        files = self.tls_files("operator")
        if files is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, tls.channel_credentials(files), options=tls.channel_options(peer_role))

    def restart_exited(self) -> list[str]:
        """Supervision, as `moemesh up` runs it (Kubernetes restarts pods the same
        way): starts every role that has exited again with its first command and
        returns their names. A rank that failed or lost its place exits on
        purpose and rejoins as the member it was (the scheduler re-forms its
        group); a gateway or scheduler comes back as a standby or follower.
        Raises RuntimeError for a role that exited more than
        MAX_RESTARTS_PER_WINDOW times within RESTART_WINDOW_S (a crash loop).
        The first call starts the supervisor (moemesh/supervisor.py), which kills
        a role that stops answering its health checks, for this to restart."""
        if self.supervisor is None:
            self.supervisor = supervisor.Supervisor(lambda: list(self.roles)).start()
        restarted = []
        now = time.monotonic()
        for role in list(self.roles):
            if role.proc.poll() is None:
                continue
            recent = [t for t in self._restarts.get(role.name, []) if now - t < RESTART_WINDOW_S]
            if len(recent) >= MAX_RESTARTS_PER_WINDOW:
                raise RuntimeError(f"{role.name} exited with {role.proc.returncode} after {len(recent)} restarts "
                                   f"in {RESTART_WINDOW_S:.0f} s; log:\n{tail(role.log_path)}")
            log.warning("%s exited with %s; restarting it", role.name, role.proc.returncode)
            self._restarts[role.name] = [*recent, now]
            self.restart(role.name)
            restarted.append(role.name)
        return restarted

    def check_alive(self) -> None:
        """Raises if any process has exited."""
        for role in self.roles:
            if role.proc.poll() is not None:
                raise RuntimeError(f"{role.name} exited with {role.proc.returncode}; log:\n{tail(role.log_path)}")

    def _write_state(self) -> None:
        state = {
            "roles": list(self.spec.roles),
            "gateway": self.gateway_address if self.has_gateway else None,
            "http": self.http_url if self.has_gateway else None,
            "schedulers": self.scheduler_addresses,
            "etcd": self.etcd_endpoint,
            "work_dir": str(self.work_dir),
            # The operator's certificates (`moemesh status`, `generate`); null without TLS.
            "tls_dir": str(self.tls_dirs["operator"]) if self.tls_dirs else None,
            "pids": {r.name: r.proc.pid for r in self.roles},
            "metrics": {r.name: f"{self.dial_host}:{r.metrics_port}" for r in self.roles if r.metrics_port},
        }
        (self.work_dir / "mesh.json").write_text(json.dumps(state, indent=2))
        if not {"gateway", "scheduler"} & set(self.spec.roles):
            return  # `generate` and `status` keep the addresses of the launch that has them
        STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        STATE_FILE.write_text(json.dumps(state, indent=2))

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """SIGTERM every process (gateway first), then SIGKILL stragglers.

        Returns each role's exit code.
        """
        codes = {}
        if self.supervisor is not None:
            self.supervisor.stop()
        for role in reversed(self.roles):
            if role.proc.poll() is None:
                role.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for role in reversed(self.roles):
            try:
                codes[role.name] = role.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", role.name, grace_s)
                os.killpg(role.proc.pid, signal.SIGKILL)
                codes[role.name] = role.proc.wait()
        if self.etcd is not None:
            self.etcd.stop()
        self.roles.clear()
        if STATE_FILE.exists():
            with contextlib.suppress(ValueError, OSError):
                if json.loads(STATE_FILE.read_text()).get("work_dir") == str(self.work_dir):
                    STATE_FILE.unlink()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return codes

    def __enter__(self) -> "Mesh":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def collective_interface_args(spec: MeshSpec) -> list[str]:
    """The expert services' --ep-interface, only when the operator named one: a
    per-host choice (interface names differ between machines), not a flag every
    deployment sets; the Kubernetes manifests leave it to the pod's interface."""
    return ["--ep-interface", spec.ep_interface] if spec.ep_interface else []


def rank_device(device: str, rank: int) -> str:
    """The device of expert service `rank`: one GPU per rank (NCCL cannot run two
    ranks of a group on one GPU), every rank on the CPU otherwise."""
    return f"cuda:{rank}" if device == "cuda" else device


def cache_dir() -> pathlib.Path:
    """Where moemesh keeps built artefacts (tokenizer, default model)."""
    return pathlib.Path(os.environ.get("MOEMESH_CACHE_DIR", pathlib.Path.home() / ".cache" / "moemesh"))


# Supervision (Mesh.restart_exited): a role that exits this often within the
# window is crash-looping, and `moemesh up` stops rather than restart it again.
MAX_RESTARTS_PER_WINDOW = 5
RESTART_WINDOW_S = 60.0

# The addresses of the mesh that `moemesh up` runs, for `generate` and `status`.
STATE_FILE = cache_dir() / "mesh.json"


def tail(path: pathlib.Path, num_lines: int = 40) -> str:
    """The last lines of a log file."""
    with contextlib.suppress(FileNotFoundError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    return "(no log)"
