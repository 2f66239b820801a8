"""The supervisor of `moemesh up`: a process that stops answering its health checks is a dead one.

`Mesh.restart_exited` (the loop `moemesh up` runs) restarts every role whose
process exited. A process that hangs (SIGSTOP, a wedged event loop) never
exits, so on its own it would hold its streams until the gateway's resume
timeout. The `Supervisor` probes every role's /readyz (services/http_probes.py:
answered on the role's event loop, so a frozen process is silent; 200 while
ready, 503 while not): a GET every `interval_s`, each with a long deadline
and several in flight at once, so that a late answer still counts and a
role whose every answer is late still answers every `interval_s`. It
judges the roles every `interval_s` by the time since their last answer
(scheduler_svc.health.SilenceJudge): a role that answered once and then is
refused `refusals` GETs in a row, or is silent for `silent_s` after a ready
answer, is SIGKILLed (its whole process group), and the next
`restart_exited` starts it again: an expert service registers as the same
member, the scheduler re-forms its group with it (or a standby took its rank
already), and the gateway resumes the streams from their checkpoints. Its
peers, which waited on it in a collective, see their connections closed by
the kill and fail at once.

A process slowed down by a loaded host answers late but answers, and is
kept. With the defaults a frozen ready process is killed 1.0 to 1.2 s after
its last answer (the group of a frozen rank does not wait for that where a
standby is registered: the scheduler's rank probe re-forms it sooner). A
process that is not ready (a rank loading its weights or joining, a
standby) holds no stream, and its loop may stall for a while on the way
(the garbage collector freezing the loaded weights' objects): its silence
counts only after `silent_not_ready_s`. A role that has not written its
metrics port yet (starting) is not probed; one that has, and never answers
any GET, is killed `silent_unheard_s` (60 s) after its first.
"""

import concurrent.futures
import dataclasses
import http.client
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from scheduler_svc.health import Health, SilenceJudge

log = logging.getLogger(__name__)

# GETs of one role in flight at once (a frozen role holds them all until their deadline).
MAX_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """How often and how patiently the supervisor probes."""

    interval_s: float = 0.2
    # Refused GETs in a row (nothing listens: the process is gone) after which it is killed.
    refusals: int = 2
    # Seconds without an answer, after a ready one, after which the process is killed:
    # above a busy gateway's longest loop stall under load.
    silent_s: float = 1.0
    # The same after a "not ready" answer (loading, joining: no stream waits on it).
    silent_not_ready_s: float = 7.5
    # Seconds from the first GET of a process that never answered any (it serves /readyz from its
    # event loop from the moment its metrics port is written, and loads its weights off the loop:
    # so long a silence is a process hung before its first answer).
    silent_unheard_s: float = 60.0
    # Deadline of one GET: long, so that a late answer still counts as one.
    deadline_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.deadline_s <= 0:
            raise ValueError(f"the supervisor needs interval_s > 0 and deadline_s > 0, got "
                             f"{self.interval_s}, {self.deadline_s}")
        self.judge()  # checks the rest

    @property
    def detection_s(self) -> tuple[float, float]:
        """The least and most time from a ready process's freeze to the kill."""
        return max(0.0, self.silent_s - self.interval_s), self.silent_s + self.interval_s

    def judge(self) -> SilenceJudge:
        try:
            return SilenceJudge(self.refusals, self.silent_s, self.silent_not_ready_s,
                                interval_s=self.interval_s, silent_unheard_s=self.silent_unheard_s)
        except ValueError as error:
            raise ValueError(f"the supervisor needs {error}") from None


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
        self._judge = config.judge()
        self._lock = threading.Lock()  # the judge and _in_flight, between the probing threads and the judging one
        self._in_flight: dict[str, int] = {}  # "name@pid" -> its GETs not answered yet
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="supervisor-probe")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
            self.judge_once()

    def judge_once(self) -> list[str]:
        """Sends every role one more GET (up to MAX_IN_FLIGHT unanswered each), forgets the
        roles gone, and kills those that stopped answering (this round's own lateness
        forgiven: SilenceJudge.tick); returns their names."""
        targets = {f"{role.name}@{role.proc.pid}": (role, port) for role in self._roles()
                   if role.proc.poll() is None and (port := role.metrics_port) is not None}
        with self._lock:
            for key in [k for k in self._in_flight if k not in targets]:
                del self._in_flight[key]
                self._judge.forget(key)
            sends = [(key, port) for key, (_, port) in targets.items() if self._in_flight.get(key, 0) < MAX_IN_FLIGHT]
            now = time.monotonic()
            for key, _ in sends:
                self._in_flight[key] = self._in_flight.get(key, 0) + 1
                self._judge.checked(key, now)
        for key, port in sends:
            self._pool.submit(self._probe_one, key, port)
        killed = []
        now = time.monotonic()
        with self._lock:
            self._judge.tick(now)
        for key, (role, _) in targets.items():
            with self._lock:
                why = self._judge.why(key, now) if self._judge.is_lost(key, now) else None
                if why is not None:
                    self._judge.forget(key)
            if why is None or role.proc.poll() is not None:
                continue
            log.warning("%s (pid %d) %s: killing it to restart it", role.name, role.proc.pid, why)
            try:
                os.killpg(role.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(role.name)
        self.killed += killed
        return killed

    def has_heard(self, role) -> bool:
        """Whether this process of `role` answered a GET yet: until it has, its silence is never
        judged (a role starting may take long to answer its first)."""
        with self._lock:
            return self._judge.heard(f"{role.name}@{role.proc.pid}")

    def _probe_one(self, key: str, port: int) -> None:
        health = self._probe(port, self.config.deadline_s)
        with self._lock:
            if key in self._in_flight:  # else the role is gone: nothing to record
                self._in_flight[key] -= 1
                self._judge.answered(key, health, time.monotonic())
