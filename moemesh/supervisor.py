"""The supervisor of `moemesh up`: a process that stops answering its health checks is a dead one.

`Mesh.restart_exited` (the loop `moemesh up` runs) restarts every role whose
process exited. A process that hangs (SIGSTOP, a wedged event loop) never
exits, so on its own it would hold its streams until the gateway's resume
timeout. The `Supervisor` probes every role's /readyz (services/http_probes.py:
answered on the role's event loop, so a frozen process is silent; 200 while
ready, 503 while not) every `interval_s` with a deadline of `timeout_s`,
concurrently; a role that answered once and then misses `misses` probes in a
row (refused, or silent after a ready answer) is SIGKILLed (its whole process
group), and the next `restart_exited` starts it again: an expert service registers as the same member, the scheduler re-forms
its group with it (or a standby took its rank already), and the gateway resumes
the streams from their checkpoints. Its peers, which waited on it in a
collective, see their connections closed by the kill and fail at once.

With the defaults a frozen ready process is killed 1.0 to 1.7 s after it
froze (the group of a frozen rank does not wait for that where a standby is
registered: the scheduler's rank probe re-forms it in 0.3 to 0.55 s). A process that is not ready (a rank loading its weights or joining,
a standby) holds no stream, and its loop may stall for a moment on the way
(the garbage collector freezing the loaded weights' objects takes about half
a second on the tiny model): its silence counts towards `misses_not_ready`
instead (about 7.5 s). A role that has not written its metrics port yet
(starting) is not probed.
"""

import concurrent.futures
import dataclasses
import http.client
import logging
import os
import signal
import threading
from collections.abc import Callable

from scheduler_svc.health import Health, MissCounter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """How often and how patiently the supervisor probes."""

    interval_s: float = 0.2
    # Deadline of one GET /readyz: above a busy gateway's longest loop stall under load.
    timeout_s: float = 0.5
    # Probes missed in a row (refused, or silent after a ready answer) after which the process is killed.
    misses: int = 3
    # Silent probes in a row after which a process whose last answer was "not ready" is killed.
    misses_not_ready: int = 15

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.misses < 1 or self.misses_not_ready < 1:
            raise ValueError(f"the supervisor needs interval_s > 0, timeout_s > 0 and misses >= 1, got "
                             f"{self.interval_s}, {self.timeout_s}, {self.misses}, {self.misses_not_ready}")

    @property
    def detection_s(self) -> tuple[float, float]:
        """The least and most time from a freeze to the kill."""
        round_s = max(self.interval_s, self.timeout_s)
        return (self.misses - 1) * round_s, self.misses * round_s + self.interval_s


def readyz(port: int, timeout_s: float) -> Health:
    """One GET /readyz on 127.0.0.1:port: SERVING on 200, REFUSED if nothing listens,
    NO_ANSWER past the deadline, NOT_SERVING for any other answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("GET", "/readyz")
        return Health.SERVING if connection.getresponse().status == 200 else Health.NOT_SERVING
    except ConnectionRefusedError:
        return Health.REFUSED
    except (TimeoutError, OSError, http.client.HTTPException):
        return Health.NO_ANSWER
    finally:
        connection.close()


class Supervisor:
    """Kills the roles that stop answering (see the module docstring); `roles()`
    gives the current roles (objects with `name`, `proc`, `metrics_port`)."""

    def __init__(self, roles: Callable[[], list], config: SupervisorConfig = SupervisorConfig(),
                 probe: Callable[[int, float], Health] = readyz):
        self._roles = roles
        self.config = config
        self._probe = probe
        self._counter = MissCounter(config.misses, frozenset({Health.REFUSED, Health.NO_ANSWER}),
                                    threshold_not_serving=config.misses_not_ready)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="supervisor-probe")
        self.killed: list[str] = []  # names of the roles it killed, in order

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.probe_once()

    def probe_once(self) -> list[str]:
        """Probes every running role once, concurrently; kills those that missed
        `misses` in a row; returns their names."""
        targets = [(role, f"{role.name}@{role.proc.pid}", port) for role in self._roles()
                   if role.proc.poll() is None and (port := role.metrics_port) is not None]
        answers = list(self._pool.map(lambda t: self._probe(t[2], self.config.timeout_s), targets))
        killed = []
        for (role, key, _), health in zip(targets, answers):
            if self._counter.observe(key, health) and role.proc.poll() is None:
                log.warning("%s (pid %d) stopped answering its health checks: killing it to restart it",
                            role.name, role.proc.pid)
                try:
                    os.killpg(role.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self._counter.forget(key)
                killed.append(role.name)
        self.killed += killed
        return killed
