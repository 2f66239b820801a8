"""The metrics relay of `moemesh up --metrics-port PORT`: one scrape target for every role started here.

`moemesh up` starts each role with `--metrics-port 0`, a free port per start, which no
Prometheus pod annotation can name (the one-pod-per-node variant runs 8 expert services in a
pod). The relay listens on one port, in the `moemesh up` process, on the HTTP server every
role uses (services/http_probes.ProbeServer):

- GET /metrics: every child's /metrics, fetched when scraped (all at once, each within
  FETCH_TIMEOUT_S), each sample with the label `member="<the child's member id>"` (a child's own
  `member` label, if it had one, is kept as `exported_member`). Families of one name from
  several children merge into one (the first child's HELP and TYPE; a child whose family has
  another type is left out of it). A child that does not answer is left out of that scrape;
  `moemesh_relay_scrape_up{member}` is 1 for each child scraped, 0 for one that was not, and
  `moemesh_relay_scrape_duration_seconds{member}` how long its answer took.
- GET /healthz: 200 while the relay's event loop runs.
- GET /readyz: 200 when every child's /readyz answers 200, else 503 with
  `{"ready": false, "not_ready": {member: why}}`; 503 too while no child is started.

`merge` (parsed families in, merged families out) is pure; `RelayServer` adds the sockets and
`RelayThread` runs it beside `moemesh up`'s main loop.
"""

import asyncio
import dataclasses
import http.client
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from services import http_probes, netaddr

log = logging.getLogger(__name__)

# The label naming the child of each sample: no moemesh metric has a label of this name.
RELAY_LABEL = "member"
# Deadline of one child's /metrics or /readyz: under ProbeServer's 2 s deadline of a readiness check.
FETCH_TIMEOUT_S = 1.5
UP_FAMILY = "moemesh_relay_scrape_up"
DURATION_FAMILY = "moemesh_relay_scrape_duration_seconds"


@dataclasses.dataclass(frozen=True, slots=True)
class Child:
    """A role process behind the relay: its member id and metrics port (None until it wrote it)."""

    member: str
    port: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class Scrape:
    """One child's answer to one scrape: its parsed families, or None and why not."""

    member: str
    families: tuple[Metric, ...] | None
    duration_s: float = 0.0
    error: str = ""


def relabel(labels: dict[str, str], member: str) -> dict[str, str]:
    """A child's sample labels plus RELAY_LABEL (a label of that name already there becomes exported_*)."""
    out = {(f"exported_{name}" if name == RELAY_LABEL else name): value for name, value in labels.items()}
    out[RELAY_LABEL] = member
    return out


def merge(scrapes: Iterable[Scrape]) -> list[Metric]:
    """The children's families as one exposition's: labelled with their member, one family per name,
    then the relay's own (ScrapeStatus). The children's families are not modified."""
    scrapes = list(scrapes)
    merged: dict[str, Metric] = {}
    for scrape in scrapes:
        for family in scrape.families or ():
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if into.type != family.type:
                log.warning("%s exports %s as a %s, another member as a %s: left out", scrape.member,
                            family.name, family.type, into.type)
                continue
            for sample in family.samples:
                into.add_sample(sample.name, relabel(sample.labels, scrape.member), sample.value,
                                sample.timestamp, sample.exemplar)
    return [*merged.values(), *ScrapeStatus(scrapes).collect()]


class ScrapeStatus:
    """The relay's own families (a prometheus_client collector): whether each child was scraped, and how long it took."""

    def __init__(self, scrapes: Sequence[Scrape] = ()):
        self._scrapes = scrapes

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(UP_FAMILY, "1 if the relay of `moemesh up --metrics-port` scraped this "
                               "member's /metrics in the last scrape, 0 if it did not answer in time.",
                               labels=[RELAY_LABEL])
        duration = GaugeMetricFamily(DURATION_FAMILY, "Seconds this member's /metrics took to answer the "
                                     "relay's last scrape (or to fail).", labels=[RELAY_LABEL])
        for scrape in self._scrapes:
            up.add_metric([scrape.member], 0.0 if scrape.families is None else 1.0)
            duration.add_metric([scrape.member], scrape.duration_s)
        yield up
        yield duration


class _Families:
    """A collector that yields families already collected."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def exposition(families: list[Metric]) -> bytes:
    """The text format (0.0.4) of families, written by prometheus_client."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


# What a GET of a child can fail with: nothing listens or it timed out (OSError, TimeoutError),
# a malformed answer (http.client.HTTPException), a body that is not text (UnicodeDecodeError).
FETCH_ERRORS = (OSError, TimeoutError, ValueError, http.client.HTTPException)


async def http_get(host: str, port: int, path: str, timeout_s: float) -> tuple[int, bytes]:
    """(status, body) of one GET, by the standard library's client on a worker thread (each socket
    operation within timeout_s, as the supervisor's probe); one of FETCH_ERRORS if none came."""
    def get() -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(netaddr.strip_brackets(host), port, timeout=timeout_s)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()
    return await asyncio.to_thread(get)


async def scrape_child(host: str, child: Child, timeout_s: float = FETCH_TIMEOUT_S) -> Scrape:
    """One child's /metrics, parsed; never raises (a failure is a Scrape without families)."""
    if child.port is None:
        return Scrape(child.member, None, error="no metrics port yet")
    start = time.monotonic()
    try:
        status, body = await http_get(host, child.port, "/metrics", timeout_s)
        if status != 200:
            raise ValueError(f"HTTP {status}")
        families = tuple(text_string_to_metric_families(body.decode()))
    except FETCH_ERRORS as error:
        return Scrape(child.member, None, time.monotonic() - start, f"{type(error).__name__}: {error}")
    return Scrape(child.member, families, time.monotonic() - start)


async def child_readiness(host: str, child: Child, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """Why a child is not ready ("" if its /readyz answered 200)."""
    if child.port is None:
        return "no metrics port yet"
    try:
        status, _ = await http_get(host, child.port, "/readyz", timeout_s)
    except FETCH_ERRORS as error:
        return f"no answer: {type(error).__name__}: {error}".rstrip(": ")
    return "" if status == 200 else f"HTTP {status}"


class RelayServer(http_probes.ProbeServer):
    """The relay's HTTP server (see the module docstring); `children()` gives the current children,
    dialled at `dial_host`, each fetch within timeout_s."""

    def __init__(self, children: Callable[[], list[Child]], dial_host: str = "127.0.0.1",
                 timeout_s: float = FETCH_TIMEOUT_S):
        super().__init__(CollectorRegistry(auto_describe=False))
        self._children = children
        self._dial_host = dial_host
        self._timeout_s = timeout_s
        self.set_readiness(self.children_readiness)

    async def metrics(self) -> bytes:
        children = self._children()
        scrapes = await asyncio.gather(*(scrape_child(self._dial_host, child, self._timeout_s) for child in children))
        for scrape in scrapes:
            if scrape.families is None:
                log.info("relay: %s left out of this scrape: %s", scrape.member, scrape.error)
        return exposition(merge(scrapes))

    async def children_readiness(self) -> dict:
        """The readiness report of /readyz: ready when every child is (see the module docstring)."""
        children = self._children()
        whys = await asyncio.gather(*(child_readiness(self._dial_host, child, self._timeout_s) for child in children))
        not_ready = {child.member: why for child, why in zip(children, whys) if why}
        report = {"ready": bool(children) and not not_ready, "members": len(children), "not_ready": not_ready}
        if not children:
            report["reason"] = "no role started yet"
        return report


class RelayThread:
    """A RelayServer (or any ProbeServer) on its own event loop in a daemon thread: `moemesh up`'s
    main thread only waits."""

    def __init__(self, server: http_probes.ProbeServer):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="metrics-relay", daemon=True)

    def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 picks a free port); returns the bound port; ValueError if it cannot bind."""
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self.server.start(host, port), self._loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops serving and ends the thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def relay_host(bind_host: str, etcd: str) -> str:
    """Where the relay of `moemesh up` listens: --bind-host, else as the roles' default (services/settings.py)
    has it: 127.0.0.1 with an etcd on this host (or none given: started here), 0.0.0.0 with one elsewhere."""
    if bind_host:
        return bind_host
    etcd_hosts = [host for host, _ in netaddr.split_endpoints(etcd)] if etcd else []
    return "127.0.0.1" if all(netaddr.is_loopback(host) for host in etcd_hosts) else "0.0.0.0"


def start_for_mesh(mesh, port: int) -> tuple[RelayThread, str]:
    """Starts the relay of a launcher.Mesh's roles (those it has when scraped: restarted ones included)
    on port; returns it and its URL. ValueError if it cannot bind."""
    if not 0 <= port <= 65535:
        raise ValueError(f"the relay's port must be in 0..65535 (0: a free one), got {port}")
    spec = mesh.spec
    server = RelayServer(lambda: [Child(role.member_id, role.metrics_port) for role in list(mesh.roles)],
                         dial_host=mesh.dial_host)
    relay = RelayThread(server)
    host = relay_host(spec.bind_host, spec.etcd)
    bound = relay.start(host, port)
    url = f"http://{mesh.dial_host if netaddr.is_wildcard(host) else host}:{bound}"
    log.info("metrics relay of the roles started here on %s (/metrics /healthz /readyz)", url)
    return relay, url
