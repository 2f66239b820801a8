"""The leader's probe of the gateways: a dead gateway's group goes to a
standby within a few hundred milliseconds instead of a lease TTL.

While it leads, the scheduler health-checks every registered gateway every
`interval_s` (one HealthChecker each: health_client.HealthCheck). A gateway whose
checks are refused `misses` times in a row (nothing listens at its address:
the process is gone; it did answer before, so it is not one still starting
or registered at an address where nothing ever listened) has its lease revoked (ClusterClient.depose_member,
only if its member key still holds that address), so its member key goes
at once and the planner gives its group to a free gateway. Only a refusal
counts: a gateway that answers NOT_SERVING (a standby, or one draining on
SIGTERM) or answers late (busy, or hung) is left to its lease, so a slow
gateway never loses its group to the probe.
"""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from scheduler_svc.health import Health, HealthChecker
from services.cluster import ClusterClient, Member, cancel_and_wait

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayProbe:
    """How the leader watches the gateways."""

    interval_s: float = 0.1
    timeout_s: float = 0.1
    # Consecutive refused checks after which the gateway's lease is revoked.
    misses: int = 2

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.misses < 1:
            raise ValueError(f"a gateway probe needs interval_s > 0, timeout_s > 0 and misses >= 1, got "
                             f"{self.interval_s}, {self.timeout_s}, {self.misses}")


async def probe_gateways(client: ClusterClient, probe: GatewayProbe,
                         new_check: Callable[[float], HealthChecker]) -> None:
    """Checks the registered gateways until cancelled (see the module docstring);
    new_check(timeout_s) makes the checker of one gateway."""
    gateways: dict[str, Member] = {}
    checks: dict[str, HealthChecker] = {}
    refused: dict[str, int] = {}
    answered: set[str] = set()  # gateways (id@address) that answered a check once

    async def follow_members() -> None:
        async with contextlib.aclosing(client.watch_members("gateway")) as changes:
            async for members in changes:
                gateways.clear()
                gateways.update((m.member_id, m) for m in members)

    async def check(gateway: Member) -> None:
        key = f"{gateway.member_id}@{gateway.address}"
        if key not in checks:
            checks[key] = new_check(probe.timeout_s)
        if await checks[key].health(gateway.address) is not Health.REFUSED:
            answered.add(key)
            refused.pop(key, None)
            return
        if key not in answered:
            return  # never seen alive at that address: not known to have died
        refused[key] = refused.get(key, 0) + 1
        if refused[key] >= probe.misses:
            refused.pop(key)
            log.warning("gateway %s at %s refused %d health checks in a row: revoking its lease",
                        gateway.member_id, gateway.address, probe.misses)
            await client.depose_member("gateway", gateway.member_id, gateway.address)

    following = asyncio.create_task(follow_members(), name="gateway-members")
    loop = asyncio.get_running_loop()
    try:
        while True:
            started = loop.time()
            current = list(gateways.values())
            await asyncio.gather(*(check(g) for g in current))
            live = {f"{g.member_id}@{g.address}" for g in current}
            for key in [k for k in checks if k not in live]:  # gone: its channel too
                await checks.pop(key).close()
                refused.pop(key, None)
                answered.discard(key)
            if following.done():  # the watch ends only when the client is closed
                return
            await asyncio.sleep(max(0.0, started + probe.interval_s - loop.time()))
    finally:
        await cancel_and_wait([following], 2.0, what="the gateway members watch")
        for health_check in checks.values():
            await health_check.close()
