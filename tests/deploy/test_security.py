"""deploy/ locks the mesh down (docs/security.md, "Kubernetes"): the rendered
NetworkPolicies, evaluated as Kubernetes does, let through exactly the
traffic the mesh needs; every pod runs without root, privileges or a
service-account token; every role mounts its TLS Secret, whose Certificate
names the role as services/tls.py checks it."""

import pytest

from services import tls
from tests.deploy.kube import COMPONENT, OVERLAYS, ROLES, find, main_container, pod_spec, role_container, workloads

ALL = [*OVERLAYS, "base"]
NAMESPACE = "moemesh"
OUTSIDE = ("other-team", {})  # a pod of another namespace, unlabelled
MONITORING = ("monitoring", {})
EPHEMERAL_PORT = 41234  # where gloo and NCCL listen: any port


def pods(docs: list[dict]) -> dict[str, dict]:
    """Component -> pod template, of every workload and Job."""
    result = {role: w["spec"]["template"] for role, w in workloads(docs).items()}
    for job in (d for d in docs if d["kind"] == "Job"):
        result[job["spec"]["template"]["metadata"]["labels"][COMPONENT]] = job["spec"]["template"]
    return result


def _matches(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _peer_admits(peer: dict, namespace: str, labels: dict) -> bool:
    if "ipBlock" in peer:
        return namespace != NAMESPACE
    namespace_ok = _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}) \
        if "namespaceSelector" in peer else namespace == NAMESPACE
    return namespace_ok and _matches(peer.get("podSelector", {}), labels)


def _port_number(pod: dict, port) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
                 if p["name"] == port]
    return number


def allows(docs, source: tuple[str, dict], target: str, port) -> bool:
    """Whether the namespace's NetworkPolicies let source (namespace, pod labels)
    reach the target component's pod on port (a name or a number)."""
    pod = pods(docs)[target]
    labels = pod["metadata"]["labels"]
    number = _port_number(pod, port)
    policies = [p for p in docs if p["kind"] == "NetworkPolicy" and "Ingress" in p["spec"]["policyTypes"]
                and _matches(p["spec"]["podSelector"], labels)]
    assert policies, f"{target} is selected by no ingress policy: open to all"
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and number not in {_port_number(pod, p["port"]) for p in ports}:
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_admits(peer, *source) for peer in peers):
                return True
    return False


def member(component: str) -> tuple[str, dict]:
    return NAMESPACE, {"app.kubernetes.io/name": "moemesh", COMPONENT: component}


@pytest.mark.parametrize("name", ALL)
def test_a_default_deny_policy_covers_the_namespace(rendered, name):
    deny = find(rendered[name], "NetworkPolicy", "moemesh-default-deny")
    assert deny["metadata"]["namespace"] == NAMESPACE
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}


@pytest.mark.parametrize("name", ALL)
def test_from_outside_only_the_gateway_api_is_reachable(rendered, name):
    docs = rendered[name]
    assert allows(docs, OUTSIDE, "gateway", "grpc") and allows(docs, OUTSIDE, "gateway", "http")
    assert not allows(docs, OUTSIDE, "gateway", "metrics")
    for target, ports in {"expert": ("grpc", "rendezvous", EPHEMERAL_PORT), "router": ("grpc",),
                          "scheduler": ("grpc",), "etcd": ("client", "peer")}.items():
        for port in ports:
            assert not allows(docs, OUTSIDE, target, port), (target, port)


@pytest.mark.parametrize("name", ALL)
def test_expert_services_only_from_gateways_schedulers_and_each_other(rendered, name):
    docs = rendered[name]
    for source in ("gateway", "scheduler", "expert"):
        assert allows(docs, member(source), "expert", "grpc"), source
    for port in ("rendezvous", EPHEMERAL_PORT):  # the collectives: experts only
        assert allows(docs, member("expert"), "expert", port)
        assert not allows(docs, member("gateway"), "expert", port)
    for source in ("router", "etcd", "etcd-auth"):
        assert not allows(docs, member(source), "expert", "grpc"), source


@pytest.mark.parametrize("name", ALL)
def test_control_roles_only_from_their_callers(rendered, name):
    docs = rendered[name]
    assert allows(docs, member("expert"), "router", "grpc")
    assert not allows(docs, member("gateway"), "router", "grpc")
    assert allows(docs, member("router"), "scheduler", "grpc")
    assert allows(docs, member("scheduler"), "scheduler", "grpc")
    assert not allows(docs, member("expert"), "scheduler", "grpc")


@pytest.mark.parametrize("name", ALL)
def test_etcd_only_from_members(rendered, name):
    docs = rendered[name]
    for source in ("gateway", "expert", "router", "scheduler", "etcd-auth"):
        assert allows(docs, member(source), "etcd", "client"), source
    assert not allows(docs, member("gateway"), "etcd", "peer")
    assert allows(docs, member("etcd"), "etcd", "peer")
    assert not allows(docs, (NAMESPACE, {COMPONENT: "debug"}), "etcd", "client")


@pytest.mark.parametrize("name", ALL)
def test_metrics_only_from_the_monitoring_namespace(rendered, name):
    docs = rendered[name]
    for target in ("gateway", "expert", "router", "scheduler", "etcd"):
        assert allows(docs, MONITORING, target, "metrics"), target
        assert not allows(docs, OUTSIDE, target, "metrics"), target
    assert not allows(docs, MONITORING, "expert", "grpc")


@pytest.mark.parametrize("name", ALL)
def test_egress_goes_only_to_dns_the_mesh_and_the_collector(rendered, name):
    for policy in (p for p in rendered[name] if p["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            assert rule.get("to"), f"{policy['metadata']['name']}: egress to anywhere"
            for peer in rule["to"]:
                assert "ipBlock" not in peer


@pytest.mark.parametrize("name", ALL)
def test_pods_run_unprivileged_without_a_token(rendered, name):
    claims = {c["metadata"]["name"] for w in workloads(rendered[name]).values()
              for c in w["spec"].get("volumeClaimTemplates", [])}
    for component, pod in pods(rendered[name]).items():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False, component
        assert spec["securityContext"]["runAsNonRoot"] is True, component
        assert spec["securityContext"]["runAsUser"] != 0, component
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (component, container["name"])
            assert context["allowPrivilegeEscalation"] is False, (component, container["name"])
            assert context["capabilities"]["drop"] == ["ALL"], (component, container["name"])
            assert "add" not in context["capabilities"]
            for mount in container.get("volumeMounts", []):
                # Writable paths are volumes of the pod (emptyDir or a claim), never the image.
                assert mount["name"] in volumes or mount["name"] in claims, (component, mount)


def secret_mounted_at(pod: dict, container: dict, path: str) -> str:
    """The secretName of the volume the container of the pod template mounts at path (read-only)."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]["secretName"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_role_mounts_its_tls_secret(rendered, name, role):
    docs = rendered[name]
    workload, container, env = role_container(docs, role)
    secret = secret_mounted_at(workload["spec"]["template"], container, env["MOEMESH_TLS_DIR"])
    assert secret == f"moemesh-{role}-tls"
    context = pod_spec(workload)["securityContext"]
    assert context["fsGroup"] == context["runAsGroup"]  # the Secret's files (0440) are readable by the role


@pytest.mark.parametrize("name", ALL)
def test_etcd_requires_client_and_peer_certificates(rendered, name):
    etcd = workloads(rendered[name])["etcd"]
    container = main_container(etcd, "etcd")
    args = container["args"]
    for flag in ("--client-cert-auth", "--peer-client-cert-auth", "--peer-cert-allowed-cn=etcd"):
        assert flag in args
    assert all(a.split("=", 1)[1].startswith("https://") for a in args
               if a.startswith(("--listen-client-urls", "--listen-peer-urls", "--advertise-client-urls")))
    assert secret_mounted_at(etcd["spec"]["template"], container, "/etc/etcd/tls") == "moemesh-etcd-tls"
    job = find(rendered[name], "Job", "moemesh-etcd-auth")
    (auth,) = job["spec"]["template"]["spec"]["containers"]
    assert auth["command"][:3] == ["python", "-m", "services.cluster.etcd_tls"]
    assert secret_mounted_at(job["spec"]["template"], auth, "/etc/moemesh/tls") == "moemesh-etcd-root-tls"


@pytest.mark.parametrize("name", OVERLAYS)
def test_cert_manager_issues_every_mounted_secret_with_the_role_names(rendered, name):
    docs = rendered[name]
    certificates = {c["spec"]["secretName"]: c["spec"] for c in docs if c["kind"] == "Certificate"}
    issuers = {i["metadata"]["name"] for i in docs if i["kind"] == "Issuer"}
    mounted = {v["secret"]["secretName"] for pod in pods(docs).values()
               for v in pod["spec"].get("volumes", []) if "secret" in v}
    # Every mounted Secret but the clients' API keys (the operator's own) is a certificate.
    assert mounted - set(certificates) == {"moemesh-api-keys"}
    for role in ROLES:
        spec = certificates[f"moemesh-{role}-tls"]
        assert spec["commonName"] == role  # etcd's user name
        assert tls.san(role) in spec["dnsNames"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
    assert tls.ETCD_SAN in certificates["moemesh-etcd-tls"]["dnsNames"]
    assert certificates["moemesh-etcd-tls"]["commonName"] == "etcd"  # --peer-cert-allowed-cn
    assert certificates["moemesh-etcd-root-tls"]["commonName"] == "root"
    for spec in certificates.values():
        assert spec["issuerRef"]["name"] in issuers
        assert spec.get("isCA") or spec["issuerRef"]["name"] == "moemesh-ca"


@pytest.mark.parametrize("name", ALL)
def test_the_namespace_enforces_the_restricted_pod_security_standard(rendered, name):
    labels = find(rendered[name], "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    allowed_volumes = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected", "downwardAPI",
                       "csi", "ephemeral"}
    for component, pod in pods(rendered[name]).items():
        assert pod["spec"]["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", component
        for volume in pod["spec"].get("volumes", []):
            assert set(volume) - {"name"} <= allowed_volumes, (component, volume)


@pytest.mark.parametrize("name", ALL)
def test_the_gateway_reads_its_api_keys_from_a_required_secret(rendered, name):
    """A deployed gateway never serves without keys: the Secret is not optional and the env names its file."""
    docs = rendered[name]
    gateway = pods(docs)["gateway"]["spec"]
    volume = next(v for v in gateway["volumes"] if v.get("secret", {}).get("secretName") == "moemesh-api-keys")
    assert not volume["secret"].get("optional", False)
    mount = next(m for c in gateway["containers"] for m in c.get("volumeMounts", []) if m["name"] == volume["name"])
    env = {k: v for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("moemesh-gateway")
           for k, v in d.get("data", {}).items()}
    assert env["MOEMESH_API_KEYS"].startswith(mount["mountPath"] + "/")
