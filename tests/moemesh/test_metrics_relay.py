"""The metrics relay of `moemesh up --metrics-port` (moemesh/metrics_relay.py): the merge of the
children's families, a child that does not answer, /readyz, and the relay over real sockets, with
ProbeServers standing in for the children and then against the shared running mesh."""

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from moemesh import cli, launcher, metrics_relay
from moemesh.metrics_relay import RELAY_LABEL, Child, Scrape
from services import http_probes

# What two children export: a counter, a histogram, a gauge, *_created gauges (as a client whose
# created series are on writes them), a family only one has; the second has a process_* gauge too.
CHILD_TEXT = """# HELP moemesh_requests_total Generate calls ended.
# TYPE moemesh_requests_total counter
moemesh_requests_total{{finish_reason="stop",code="OK"}} {requests}
# HELP moemesh_requests_created Generate calls ended.
# TYPE moemesh_requests_created gauge
moemesh_requests_created{{finish_reason="stop",code="OK"}} 1.7e+09
# HELP moemesh_step_seconds Steps.
# TYPE moemesh_step_seconds histogram
moemesh_step_seconds_bucket{{le="0.1"}} 1.0
moemesh_step_seconds_bucket{{le="1.0"}} {steps}
moemesh_step_seconds_bucket{{le="+Inf"}} {steps}
moemesh_step_seconds_count {steps}
moemesh_step_seconds_sum 0.5
# HELP moemesh_queue_length Queued.
# TYPE moemesh_queue_length gauge
moemesh_queue_length {queued}
"""
SECOND_ONLY = """# HELP process_open_fds Open fds.
# TYPE process_open_fds gauge
process_open_fds 12.0
"""


def parsed(text: str) -> tuple:
    return tuple(text_string_to_metric_families(text))


def two_children() -> list[Scrape]:
    return [Scrape("expert-a-0", parsed(CHILD_TEXT.format(requests=3.0, steps=2.0, queued=1.0)), 0.01),
            Scrape("expert-a-1", parsed(CHILD_TEXT.format(requests=5.0, steps=4.0, queued=0.0) + SECOND_ONLY), 0.02)]


def samples_of(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of an exposition, which must parse."""
    return {(s.name, frozenset(s.labels.items())): s.value for f in parsed(text) for s in f.samples}


def test_merge_labels_every_sample_with_its_member_and_keeps_one_family_per_name():
    scrapes = two_children()
    text = metrics_relay.exposition(metrics_relay.merge(scrapes)).decode()
    families = {f.name: f for f in parsed(text)}
    assert text.count("# TYPE moemesh_requests_total counter") == 1 and text.count("# HELP moemesh_step_seconds ") == 1
    assert (families["moemesh_requests"].type, families["moemesh_step_seconds"].type,
            families["moemesh_queue_length"].type, families["moemesh_requests_created"].type) == \
        ("counter", "histogram", "gauge", "gauge")
    got = samples_of(text)
    # Every child's sample, and only those, is there with its member label added.
    expected = {(s.name, frozenset({**s.labels, RELAY_LABEL: scrape.member}.items())): s.value
                for scrape in scrapes for f in scrape.families for s in f.samples}
    assert {k: v for k, v in got.items() if not k[0].startswith("moemesh_relay_")} == expected
    assert got[("moemesh_requests_total", frozenset({"finish_reason": "stop", "code": "OK",
                                                     RELAY_LABEL: "expert-a-1"}.items()))] == 5.0
    # Each member's histogram whole: its buckets (le kept), _count and _sum.
    for member, steps in (("expert-a-0", 2.0), ("expert-a-1", 4.0)):
        buckets = {dict(labels)["le"]: v for (name, labels), v in got.items()
                   if name == "moemesh_step_seconds_bucket" and dict(labels)[RELAY_LABEL] == member}
        assert buckets == {"0.1": 1.0, "1.0": steps, "+Inf": steps}
        assert got[("moemesh_step_seconds_count", frozenset({RELAY_LABEL: member}.items()))] == steps
    assert got[("process_open_fds", frozenset({RELAY_LABEL: "expert-a-1"}.items()))] == 12.0
    assert {dict(k[1])[RELAY_LABEL]: v for k, v in got.items() if k[0] == metrics_relay.UP_FAMILY} == \
        {"expert-a-0": 1.0, "expert-a-1": 1.0}


def test_a_child_that_did_not_answer_is_left_out_and_its_up_gauge_is_0():
    first, _ = two_children()
    text = metrics_relay.exposition(metrics_relay.merge([first, Scrape("expert-a-1", None, 1.5, "TimeoutError")]))
    got = samples_of(text.decode())
    members = {dict(labels)[RELAY_LABEL] for name, labels in got if not name.startswith("moemesh_relay_")}
    assert members == {"expert-a-0"}
    up = {dict(labels)[RELAY_LABEL]: v for (name, labels), v in got.items() if name == metrics_relay.UP_FAMILY}
    assert up == {"expert-a-0": 1.0, "expert-a-1": 0.0}
    assert got[(metrics_relay.DURATION_FAMILY, frozenset({RELAY_LABEL: "expert-a-1"}.items()))] == 1.5


def test_a_childs_own_member_label_is_kept_apart_and_a_family_of_another_type_left_out():
    assert metrics_relay.relabel({RELAY_LABEL: "x", "le": "1"}, "gw") == {"exported_member": "x", "le": "1",
                                                                           RELAY_LABEL: "gw"}
    clash = parsed("# HELP moemesh_queue_length Queued.\n# TYPE moemesh_queue_length counter\n"
                   "moemesh_queue_length_total 7.0\n")
    merged = metrics_relay.merge([*two_children(), Scrape("odd", clash)])
    (queue,) = [f for f in merged if f.name == "moemesh_queue_length"]
    assert queue.type == "gauge" and {s.labels[RELAY_LABEL] for s in queue.samples} == {"expert-a-0", "expert-a-1"}


def test_no_moemesh_metric_has_a_label_named_like_the_relays():
    from services import metrics
    from tests.services.test_telemetry import all_metric_families

    registry = CollectorRegistry()
    for cls in (metrics.CommonMetrics, metrics.GatewayMetrics, metrics.ExpertMetrics, metrics.SchedulerMetrics):
        for metric in vars(cls(registry)).values():
            assert RELAY_LABEL not in getattr(metric, "_labelnames", ()), metric
    assert {metrics_relay.UP_FAMILY, metrics_relay.DURATION_FAMILY} <= set(all_metric_families())


# --- over sockets: ProbeServers stand in for the children ---

def free_port_with_nothing_listening() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


class FakeChildren:
    """Two children, each a ProbeServer with its own registry and readiness on its own loop; the test
    appends more members (a port nothing listens on, none yet) to `children`."""

    def __init__(self):
        self.ready = {"expert-a-0": True, "expert-a-1": True}
        self.children: list[Child] = []
        self.threads = []
        for index, member in enumerate(self.ready):
            registry = CollectorRegistry()
            Counter("moemesh_requests", "Generate calls ended.", ["code"], registry=registry).labels("OK").inc(index + 1)
            server = http_probes.ProbeServer(registry)
            server.set_readiness(lambda member=member: {"ready": self.ready[member]})
            self.threads.append(metrics_relay.RelayThread(server))
            self.children.append(Child(member, self.threads[-1].start("127.0.0.1", 0)))

    def stop(self) -> None:
        for thread in self.threads:
            thread.stop()


@pytest.fixture
def relay_url():
    """(the relay's URL, its children)."""
    children = FakeChildren()
    relay = metrics_relay.RelayThread(metrics_relay.RelayServer(lambda: list(children.children), timeout_s=2.0))
    port = relay.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}", children
    relay.stop()
    children.stop()


def test_the_relay_serves_every_childs_metrics_and_leaves_out_one_that_is_gone(relay_url):
    url, children = relay_url
    assert get(url + "/healthz") == (200, "ok\n")
    status, text = get(url + "/metrics")
    got = samples_of(text)
    assert status == 200
    assert got[("moemesh_requests_total", frozenset({"code": "OK", RELAY_LABEL: "expert-a-1"}.items()))] == 2.0
    assert got[("moemesh_requests_total", frozenset({"code": "OK", RELAY_LABEL: "expert-a-0"}.items()))] == 1.0
    children.children.append(Child("expert-a-2", free_port_with_nothing_listening()))
    up = {dict(k[1])[RELAY_LABEL]: v for k, v in samples_of(get(url + "/metrics")[1]).items()
          if k[0] == metrics_relay.UP_FAMILY}
    assert up == {"expert-a-0": 1.0, "expert-a-1": 1.0, "expert-a-2": 0.0}


def test_readyz_is_200_only_when_every_child_is_ready_and_names_those_that_are_not(relay_url):
    url, children = relay_url
    status, body = get(url + "/readyz")
    assert status == 200 and json.loads(body) == {"ready": True, "members": 2, "not_ready": {}}
    children.ready["expert-a-1"] = False
    children.children.append(Child("expert-a-2", None))
    status, body = get(url + "/readyz")
    assert status == 503
    assert json.loads(body)["not_ready"] == {"expert-a-1": "HTTP 503", "expert-a-2": "no metrics port yet"}
    children.children[-1] = Child("expert-a-2", free_port_with_nothing_listening())
    assert set(json.loads(get(url + "/readyz")[1])["not_ready"]) == {"expert-a-1", "expert-a-2"}
    children.children.pop()
    children.ready["expert-a-1"] = True
    assert get(url + "/readyz")[0] == 200


def test_a_relay_without_children_is_not_ready():
    relay = metrics_relay.RelayThread(metrics_relay.RelayServer(list))
    port = relay.start("127.0.0.1", 0)
    try:
        status, body = get(f"http://127.0.0.1:{port}/readyz")
        assert status == 503 and json.loads(body)["reason"] == "no role started yet"
    finally:
        relay.stop()


# --- moemesh up's side ---

def test_up_has_the_relay_off_by_default_and_takes_a_port():
    parser = cli.build_parser()
    assert parser.parse_args(["up"]).metrics_port is None
    assert parser.parse_args(["up", "--metrics-port", "9090"]).metrics_port == 9090


def test_the_relay_binds_like_the_roles_and_names_members_by_their_ids(tmp_path):
    assert metrics_relay.relay_host("0.0.0.0", "10.0.0.1:2379") == "0.0.0.0"
    assert metrics_relay.relay_host("", "") == metrics_relay.relay_host("", "127.0.0.1:2379") == "127.0.0.1"
    assert metrics_relay.relay_host("", "127.0.0.1:2379,10.0.0.1:2379") == "0.0.0.0"
    role = launcher.Role(name="expert-3", proc=None, port_file=tmp_path / "p", log_path=tmp_path / "l",
                         cmd=["python", "-m", "expert_svc.main", "--member-id", "expert-10-0-0-2-3", "--port", "0"])
    assert role.member_id == "expert-10-0-0-2-3"
    assert launcher.Role(name="router", proc=None, port_file=tmp_path / "p", log_path=tmp_path / "l").member_id == \
        "router"


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_bad_port_is_refused_naming_it(port):
    with pytest.raises(ValueError, match=f"0..65535 .*got {port}"):
        metrics_relay.start_for_mesh(None, port)


def test_up_exits_with_status_2_on_a_port_it_cannot_have_before_starting_anything(tiny_model_dir, capsys):
    assert cli.main(["up", "--model", str(tiny_model_dir), "--metrics-port", "-5"]) == 2
    assert "moemesh up: --metrics-port: the relay's port must be in 0..65535 (0: a free one), got -5" in \
        capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["up", "--model", str(tiny_model_dir), "--metrics-port", str(port)]) == 2
    assert f"cannot bind the metrics server to 127.0.0.1:{port}" in capsys.readouterr().err


def scrape_until_all_up(url: str, members: set[str], attempts: int = 5) -> dict:
    """samples_of the relay's /metrics once every member answered in time (a loaded host can make
    one late for a scrape), or of the last of `attempts` scrapes a second apart."""
    for attempt in range(attempts):
        got = samples_of(get(url + "/metrics")[1])
        up = {dict(k[1])[RELAY_LABEL]: v for k, v in got.items() if k[0] == metrics_relay.UP_FAMILY}
        if up == dict.fromkeys(members, 1.0) or attempt == attempts - 1:
            return got
        time.sleep(1.0)


def readyz_until_200(url: str, attempts: int = 5) -> tuple[int, str]:
    """The relay's /readyz once it is 200, or the last of `attempts` answers a second apart."""
    for attempt in range(attempts):
        status, body = get(url + "/readyz")
        if status == 200 or attempt == attempts - 1:
            return status, body
        time.sleep(1.0)


def test_the_relay_of_the_shared_mesh_has_every_role_up_and_ready(mesh):
    relay, url = metrics_relay.start_for_mesh(mesh, 0)
    try:
        members = {role.member_id for role in mesh.roles}
        assert members >= {"gateway-0", "router-0", "expert-0", "scheduler-0"}
        got = scrape_until_all_up(url, members)
        up = {dict(k[1])[RELAY_LABEL]: v for k, v in got.items() if k[0] == metrics_relay.UP_FAMILY}
        assert up == dict.fromkeys(members, 1.0)
        build = {dict(labels)[RELAY_LABEL]: dict(labels)["member_id"] for name, labels in got
                 if name == "moemesh_build_info"}
        assert build == {member: member for member in members}   # each role's own samples under its id
        status, body = readyz_until_200(url)
        assert status == 200, body
    finally:
        relay.stop()
