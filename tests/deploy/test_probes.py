"""The liveness probes find a frozen process (issue 32: a hung service is a lost one):
every role's liveness asks /healthz, answered on its event loop (a SIGSTOPped process
still completes TCP handshakes, so a TCP probe never fails), and the settings give the
detection time the manifests' comments state."""

import pytest

from tests.deploy.kube import OVERLAYS, ROLES, role_container

# Most seconds from a freeze to the kubelet's kill, per role (the manifests' comments).
MAX_DETECTION_S = {"expert": 4, "gateway": 4, "router": 7, "scheduler": 7}


def detection_s(probe: dict) -> float:
    """The most time from a freeze to the last failed probe: failureThreshold periods plus a timeout."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3) + probe.get("timeoutSeconds", 1)


@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
@pytest.mark.parametrize("role", sorted(ROLES))
def test_liveness_finds_a_frozen_process_within_the_stated_time(rendered, name, role):
    _, container, _ = role_container(rendered[name], role)
    liveness = container["livenessProbe"]
    assert liveness.get("httpGet") == {"path": "/healthz", "port": "metrics"}, f"{role}: {liveness}"
    assert detection_s(liveness) <= MAX_DETECTION_S[role], (role, liveness)
    # Only a frozen loop fails it: a pause of a healthy one (a GC, a burst) stays under the deadline.
    assert liveness["timeoutSeconds"] >= 1 and liveness["failureThreshold"] >= 3
