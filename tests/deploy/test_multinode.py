"""deploy/overlays/qwen3-235b-2x8: Qwen3-235B-A22B's 16 ranks over two 8-GPU nodes. The expert
StatefulSet spreads over the labelled nodes (8 and 8, never one node), etcd stays a 3-member
StatefulSet with its own disruption budget and headless peer Service, spread over zones and kept
off the GPU nodes where it can be, and the collective's settings (the exchange design, the cost
model's constants, the sockets' interface) reach the expert's config as its process builds it."""

from services.model.exchange.cost_model import LinkCosts
from tests.deploy.kube import find, main_container, pod_spec, role_config, role_container, workloads

NAME = "qwen3-235b-2x8"
EXPERT_LABELS = {"app.kubernetes.io/name": "moemesh", "app.kubernetes.io/component": "expert"}


def test_the_experts_spread_evenly_over_the_labelled_gpu_nodes(rendered):
    expert = workloads(rendered[NAME])["expert"]
    spec = pod_spec(expert)
    assert expert["spec"]["replicas"] == 16
    assert spec["nodeSelector"] == {"moemesh.io/expert-pool": "qwen3-235b"}
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "DoNotSchedule" and spread["minDomains"] == 2
    assert spread["labelSelector"]["matchLabels"] == EXPERT_LABELS
    assert main_container(expert, "expert")["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_etcd_is_three_members_with_a_budget_a_peer_service_and_a_zone_spread(rendered):
    docs = rendered[NAME]
    etcd = workloads(docs)["etcd"]
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["serviceName"] == "moemesh-etcd"
    peers = find(docs, "Service", "moemesh-etcd")["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in peers["ports"]} == {"client": 2379, "peer": 2380}
    assert find(docs, "PodDisruptionBudget", "moemesh-etcd")["spec"]["minAvailable"] == 2
    spec = pod_spec(etcd)
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    # one member per node stays the base's hard rule; the overlay's preferences only add to it
    assert spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    members = next(a for a in main_container(etcd, "etcd")["args"] if a.startswith("--initial-cluster="))
    assert members.count("=https://moemesh-etcd-") == 3 and members.count(".moemesh-etcd.") == 3  # via the peer Service


def test_the_control_plane_prefers_nodes_outside_the_expert_pool(rendered):
    for role in ("etcd", "scheduler", "router", "gateway"):
        affinity = pod_spec(workloads(rendered[NAME])[role])["affinity"]["nodeAffinity"]
        (preferred,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
        assert preferred["preference"]["matchExpressions"] == [
            {"key": "moemesh.io/expert-pool", "operator": "DoesNotExist"}], role
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity, role


def test_the_collective_settings_reach_the_expert_config(rendered):
    config = role_config(rendered[NAME], "expert")
    assert config.ep_dispatch == "auto" and config.device == "cuda"
    costs = LinkCosts.for_device("cuda", config.ep_link_costs)
    assert costs.network.bytes_per_s == 45e9 and costs.network.latency_s == 25e-6
    _workload, _container, env = role_container(rendered[NAME], "expert")
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    # every pod is its own host to the cost model (the pod network): no node name is set
    assert "MOEMESH_EP_NODE" not in env and config.ep_node == ""
    assert role_config(rendered[NAME], "scheduler").group_size == 16
