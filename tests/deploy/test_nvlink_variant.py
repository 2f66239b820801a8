"""deploy/variants/qwen3-235b-2x8-nvlink: the 2x8 overlay with one expert pod per node, 8 GPUs and
8 expert services under `moemesh up --roles expert --ranks 8`, so that NCCL sees each node's 8
ranks as one host (NVLink). Renders and validates like the overlays; its command is one `moemesh
up` accepts; the 8 processes it starts build expert configs from the pod's env that register
distinct member ids, free ports and the node's name; the sizes still make one group of 16."""

import json
import re

import kubernetes_validate
import pytest

from expert_svc.config import ExpertConfig
from moemesh import cli, launcher, metrics_relay
from services import settings
from services.model import random_weights
from tests.deploy import kube
from tests.deploy import test_manifests as manifests
from tests.deploy.kube import DEPLOY, find, main_container, pod_spec, render, role_config, workloads

VARIANT = DEPLOY / "variants" / "qwen3-235b-2x8-nvlink"
NODE_NAME = "gpu-node-a"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render(VARIANT)


@pytest.fixture
def expert(docs, monkeypatch):
    """(workload, container, env with the downward API's values, `moemesh up`'s parsed args)."""
    monkeypatch.setitem(kube.DOWNWARD, "spec.nodeName", NODE_NAME)
    workload = workloads(docs)["expert"]
    container = main_container(workload, "expert")
    env = kube.container_env(docs, workload, container)
    command = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["command"]]
    assert command[:2] == ["moemesh", "up"]
    return workload, container, env, cli.build_parser().parse_args(command[1:])


def mesh_spec(args, tmp_path) -> launcher.MeshSpec:
    """The MeshSpec `moemesh up` builds from args; the checkpoint (a volume in the pod) stands in
    as Qwen3-235B-A22B's config.json, the only file the spec reads."""
    (tmp_path / "config.json").write_text(json.dumps(random_weights.preset("qwen3-235b-a22b").to_hub_dict()))
    return cli.mesh_spec(args, str(tmp_path))


def test_renders_valid_objects_for_every_kubernetes_version(docs):
    for doc in docs:
        if doc["apiVersion"].startswith("cert-manager.io/"):
            continue
        for version in manifests.KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_one_pod_per_node_with_its_eight_gpus_and_one_group_of_sixteen(docs, expert, tmp_path):
    workload, container, env, args = expert
    assert args.model == env["MOEMESH_MODEL"]
    spec = mesh_spec(args, tmp_path)
    assert (spec.roles, spec.num_ranks, spec.device) == (("expert",), 8, "cuda")
    assert workload["spec"]["replicas"] == 2
    (spread,) = pod_spec(workload)["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["maxSkew"], spread["minDomains"], spread["whenUnsatisfiable"]) == \
        ("kubernetes.io/hostname", 1, 2, "DoNotSchedule")   # 1 and 1: never both pods on one node
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == spec.num_ranks
    per_rank = int(workload["metadata"]["annotations"]["moemesh/experts-per-rank"])
    group_size = role_config(docs, "scheduler").group_size
    assert workload["spec"]["replicas"] * spec.num_ranks == group_size == 16
    assert group_size * per_rank == int(workload["metadata"]["annotations"]["moemesh/model-num-experts"]) == 128
    assert "livenessProbe" not in container and "startupProbe" not in container   # the supervisor's job
    # Ready when the relay of `moemesh up` says every process is (moemesh/metrics_relay.py).
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["readinessProbe"]["timeoutSeconds"] > metrics_relay.FETCH_TIMEOUT_S


def test_prometheus_scrapes_the_relay_of_all_eight_on_the_pods_metrics_port(docs, expert):
    workload, container, env, args = expert
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/path"]) == ("true", "/metrics")
    assert int(annotations["prometheus.io/port"]) == args.metrics_port == kube.port_named(container, "metrics")
    assert container["ports"] == [{"name": "metrics", "containerPort": args.metrics_port}]   # the only fixed one
    (monitoring,) = find(docs, "NetworkPolicy", "moemesh-metrics")["spec"]["ingress"]
    assert monitoring["ports"] == [{"port": "metrics"}]
    assert monitoring["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


def test_each_process_registers_its_own_id_and_ports_and_the_nodes_name(expert, tmp_path):
    _workload, _container, env, args = expert
    spec = mesh_spec(args, tmp_path)
    assert spec.etcd == env["MOEMESH_ETCD"]
    assert spec.member_tag == "moemesh-expert-0" and spec.advertise_host == kube.DOWNWARD["status.podIP"]
    configs = []
    for rank in range(spec.num_ranks):
        # What Mesh._start_all and _spawn give expert service `rank`, over the pod's env.
        flags = ["--etcd", spec.etcd, "--bind-host", spec.bind_host, "--advertise-host", spec.advertise_host,
                 "--member-id", f"expert-{spec.member_tag}-{rank}", "--model", spec.model_dir,
                 "--device", launcher.rank_device(spec.device, rank),
                 "--num-spare-expert-slots", spec.num_spare_expert_slots, "--port", "0",
                 "--port-file", f"/tmp/moemesh/expert-{rank}.port", "--metrics-port", "0"]
        configs.append(settings.parse_config(ExpertConfig, flags, env=env))
    assert [c.device for c in configs] == [f"cuda:{r}" for r in range(8)]
    assert len({c.member_id for c in configs}) == 8
    # Ranks follow member ids: this pod's 8 are ranks 0-7, the other pod's 8-15.
    assert sorted(c.member_id for c in configs) == [c.member_id for c in configs] < [
        f"expert-moemesh-expert-1-{r}" for r in range(8)]
    assert all(c.rendezvous_port == 0 and c.port == 0 for c in configs)   # free ports, no clash
    assert all(c.metrics_port == 0 for c in configs) and env["MOEMESH_METRICS_PORT"] == str(args.metrics_port)
    assert all(c.ep_node == NODE_NAME and c.ep_dispatch == "auto" for c in configs)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0" and env["NCCL_P2P_LEVEL"] == "NVL"


def test_the_gateway_and_schedulers_may_reach_the_free_ports(docs):
    policy = find(docs, "NetworkPolicy", "moemesh-expert")
    control, peers = policy["spec"]["ingress"]
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in control["from"]} == \
        {"gateway", "scheduler"}
    assert control["ports"] == [{"protocol": "TCP", "port": 1024, "endPort": 65535}]
    assert "ports" not in peers
    assert "ports" not in find(docs, "Service", "moemesh-expert")["spec"]
