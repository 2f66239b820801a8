"""deploy/: every overlay renders with kustomize, validates against the
Kubernetes schemas offline, and agrees with the code: ports and probes with
the flags, env vars with the config dataclasses, entrypoints with the role
modules, expert replicas with the model and the scheduler's group size."""

import copy
import importlib
from importlib import metadata

import kubernetes_validate
import pytest

from moemesh import etcd
from services import settings
from services.model.make_model import PRESETS
from tests.deploy.dockerfile import DOCKERFILE, ROLE_MODULES, entrypoint, stages
from tests.deploy.kube import (
    COMPONENT, DOWNWARD, GPU_OVERLAYS, OVERLAYS, ROLES, field_ref, find, main_container, pod_spec, port_named,
    role_config, role_container, workloads,
)

# The oldest Kubernetes the manifests support (native gRPC probes are GA
# since 1.27, the preStop sleep action is on by default since 1.30) and the
# newest the bundled schemas know.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Experts per MoE layer of public checkpoints (their config.json, num_experts).
PUBLIC_MODELS = {"Qwen3-235B-A22B": 128, "Qwen3-30B-A3B": 128}
ALL = [*OVERLAYS, "base"]


def test_the_four_overlays_exist():
    assert set(OVERLAYS) == {"local-cpu", "h100x8", "qwen3-235b", "qwen3-235b-2x8"}


@pytest.mark.parametrize("name", ALL)
def test_renders_valid_objects_for_every_kubernetes_version(rendered, name):
    for doc in rendered[name]:
        if doc["apiVersion"].startswith("cert-manager.io/"):
            continue  # a CRD without a bundled schema: tests/deploy/test_security.py checks them
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} (k8s {version}): {error}")


def test_schema_validation_rejects_broken_objects(rendered):
    gateway = find(rendered["local-cpu"], "Deployment", "moemesh-gateway")
    typo = copy.deepcopy(gateway)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["portt"] = 1
    wrong_type = copy.deepcopy(gateway)
    wrong_type["spec"]["replicas"] = "one"
    for doc in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", ALL)
def test_every_role_runs_as_the_issue_asks(rendered, name):
    docs = rendered[name]
    loads = workloads(docs)
    assert set(loads) == {*ROLES, "etcd"}
    for role, spec in ROLES.items():
        assert loads[role]["kind"] == spec.kind, role
    for role in ("etcd", "scheduler"):
        assert loads[role]["spec"]["replicas"] == 3
        assert loads[role]["spec"]["podManagementPolicy"] == "Parallel"
        anti = pod_spec(loads[role])["affinity"]["podAntiAffinity"]
        terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution") or [
            t["podAffinityTerm"] for t in anti["preferredDuringSchedulingIgnoredDuringExecution"]]
        assert terms[0]["labelSelector"]["matchLabels"][COMPONENT] == role
        assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
        if name != "local-cpu":
            assert "requiredDuringSchedulingIgnoredDuringExecution" in anti, f"{role}: anti-affinity is soft"
    for workload in loads.values():
        if workload["kind"] == "StatefulSet":
            service = find(docs, "Service", workload["spec"]["serviceName"])
            assert service["spec"]["clusterIP"] == "None", "a StatefulSet's service must be headless"
            for claim in workload["spec"].get("volumeClaimTemplates", []):
                # Immutable in a StatefulSet: a label that changes per release breaks `kubectl apply`.
                assert "app.kubernetes.io/version" not in claim["metadata"].get("labels", {})
    assert find(docs, "Service", "moemesh-expert")["spec"]["publishNotReadyAddresses"] is True
    assert find(docs, "Service", "moemesh-gateway")["spec"]["type"] == "ClusterIP"
    assert loads["expert"]["spec"]["updateStrategy"]["type"] == "OnDelete"


@pytest.mark.parametrize("name", ALL)
def test_every_service_selects_pods_with_its_target_ports(rendered, name):
    docs = rendered[name]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        selected = [w for w in workloads(docs).values()
                    if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)} workloads"
        names = {p["name"] for c in pod_spec(selected[0])["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"{service['metadata']['name']}: no container port {port}"


@pytest.mark.parametrize("name", ALL)
def test_every_workload_has_a_disruption_budget_over_its_pods(rendered, name):
    budgets = [d for d in rendered[name] if d["kind"] == "PodDisruptionBudget"]
    for role, workload in workloads(rendered[name]).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets
                    if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, f"{role}: {len(covering)} PodDisruptionBudgets"
        if role in ("etcd", "scheduler"):
            assert covering[0]["spec"]["minAvailable"] == 2  # a majority of 3


def test_etcd_runs_with_the_raft_timing_of_the_local_etcd(rendered):
    for name in ALL:
        args = main_container(workloads(rendered[name])["etcd"], "etcd")["args"]
        assert f"--heartbeat-interval={etcd._HEARTBEAT_MS}" in args
        assert f"--election-timeout={etcd._ELECTION_TIMEOUT_MS}" in args
        members = next(a for a in args if a.startswith("--initial-cluster="))
        assert members.count("=https://") == 3


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", sorted(ROLES))
def test_container_agrees_with_the_role_config(rendered, name, role):
    _workload, container, env = role_container(rendered[name], role)
    config_cls = ROLES[role].config_cls
    fields = {f.name for f in config_cls.__dataclass_fields__.values()}
    unknown = {v for v in env if v.startswith(settings.ENV_PREFIX)} - {settings.env_var(f) for f in fields}
    assert not unknown, f"{role}: {sorted(unknown)} are not fields of {config_cls.__name__}"
    # The values are what the process parses: flags (args) over env over defaults.
    try:
        config = role_config(rendered[name], role)
    except SystemExit:
        pytest.fail(f"{name}: {role}'s env/args do not build a {config_cls.__name__}: {env}")
    assert field_ref(container, "MOEMESH_MEMBER_ID") == "metadata.name"
    assert field_ref(container, "MOEMESH_ADVERTISE_HOST") == "status.podIP"
    assert config.host == "0.0.0.0"
    assert config.address(config.port) == f"{DOWNWARD['status.podIP']}:{config.port}"
    # Ports: the flag's port is the container port; probes are TCP on it or HTTP
    # on the metrics port (kubelet's gRPC probes cannot speak TLS).
    assert config.port > 0 and port_named(container, "grpc") == config.port
    assert port_named(container, "metrics") == config.metrics_port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        action = container[probe]
        assert "grpc" not in action, f"{role} {probe}: a gRPC probe cannot pass mutual TLS"
        if "tcpSocket" in action:
            assert action["tcpSocket"]["port"] == config.port, f"{role} {probe}"
        else:
            assert action["httpGet"]["port"] == "metrics", f"{role} {probe}"
            assert action["httpGet"]["path"] in ("/healthz", "/readyz"), f"{role} {probe}"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    if role == "expert":
        assert port_named(container, "rendezvous") == config.rendezvous_port
    # The entrypoint: the role's module, as the image's.
    assert container["command"] == ["python", "-m", ROLES[role].module]
    assert callable(importlib.import_module(ROLES[role].module).main)
    image, _, tag = container["image"].partition(":")
    target = image.removeprefix("moemesh/")
    assert entrypoint(stages(DOCKERFILE.read_text()), target) == container["command"]
    assert ROLE_MODULES[target] == ROLES[role].module
    assert tag == metadata.version("moemesh")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", sorted(ROLES))
def test_telemetry_settings(rendered, name, role):
    workload, container, env = role_container(rendered[name], role)
    assert env["OTEL_SERVICE_NAME"] == f"moemesh-{role}"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http")
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    metrics_port = int(annotations["prometheus.io/port"])
    assert port_named(container, "metrics") == metrics_port
    if "metrics_port" in ROLES[role].config_cls.__dataclass_fields__:  # issue 7: the HTTP port of /metrics
        assert role_config(rendered[name], role).metrics_port == metrics_port, "set MOEMESH_METRICS_PORT to the scraped port"


@pytest.mark.parametrize("name", ALL)
def test_gateway_outlives_its_shutdown_grace(rendered, name):
    workload, container, _env = role_container(rendered[name], "gateway")
    config = role_config(rendered[name], "gateway")
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod_spec(workload)["terminationGracePeriodSeconds"] >= config.shutdown_grace_s + pre_stop + 5


def expert_sizing(docs: list[dict]) -> tuple[int, int, int, int]:
    """(expert replicas, experts per rank and model experts as annotated, scheduler group size)."""
    expert = workloads(docs)["expert"]
    annotations = expert["metadata"].get("annotations", {})
    return (expert["spec"]["replicas"], int(annotations["moemesh/experts-per-rank"]),
            int(annotations["moemesh/model-num-experts"]), role_config(docs, "scheduler").group_size)


def model_num_experts(docs: list[dict]) -> int | None:
    """The served model's experts, where the code or a public config knows them."""
    workload, _container, env = role_container(docs, "expert")
    model = env["MOEMESH_MODEL"]
    for init in pod_spec(workload).get("initContainers", []):
        command = init["command"]
        if command[:2] == ["moemesh", "make-model"]:
            assert command[2] == model, "the init container writes another model than the one served"
            return PRESETS[command[command.index("--preset") + 1]].num_experts
    return PUBLIC_MODELS.get(model.rstrip("/").rsplit("/", 1)[-1])


@pytest.mark.parametrize("name", OVERLAYS)
def test_expert_replicas_cover_the_model_in_one_group(rendered, name):
    replicas, per_rank, num_experts, group_size = expert_sizing(rendered[name])
    assert replicas * per_rank == num_experts
    assert group_size == replicas, "--group-size must equal the expert replicas"
    assert num_experts % group_size == 0  # what the rank checks before loading
    known = model_num_experts(rendered[name])
    if name != "h100x8":  # h100x8 serves the operator's own 64-expert checkpoint
        assert known == num_experts


def test_overlay_sizes(rendered):
    assert expert_sizing(rendered["h100x8"]) == (8, 8, 64, 8)
    assert expert_sizing(rendered["qwen3-235b"]) == (8, 16, 128, 8)
    assert expert_sizing(rendered["qwen3-235b-2x8"]) == (16, 8, 128, 16)
    assert expert_sizing(rendered["local-cpu"])[0] * 4 == PRESETS["tiny"].num_experts


@pytest.mark.parametrize("name", ALL)
def test_one_gpu_per_expert_exactly_in_the_gpu_overlays(rendered, name):
    docs = rendered[name]
    loads = workloads(docs)
    _workload, expert, _env = role_container(docs, "expert")
    config = role_config(docs, "expert")
    is_gpu = name in GPU_OVERLAYS
    assert config.device == ("cuda" if is_gpu else "cpu")
    assert expert["image"].startswith("moemesh/expert-cuda:" if is_gpu else "moemesh/expert-cpu:")
    for kind in ("requests", "limits"):
        assert expert["resources"][kind].get("nvidia.com/gpu") == (1 if is_gpu else None)
    for role, workload in loads.items():
        spec = pod_spec(workload)
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {"requests", "limits"} <= set(container["resources"]), f"{name} {role}: no requests/limits"
            if role != "expert":
                assert "nvidia.com/gpu" not in container["resources"]["limits"]
