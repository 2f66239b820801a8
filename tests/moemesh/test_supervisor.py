"""The supervisor of `moemesh up` (moemesh/supervisor.py): a ready process whose /readyz stops
answering (SIGSTOP) is killed after the configured silence, and Mesh.restart_exited starts
it again; a process that answers however late, one never seen answering, or one not ready
for a while (loading) is left alone."""

import os
import pathlib
import signal
import sys
import time

import pytest

from moemesh import launcher
from moemesh.supervisor import Supervisor, SupervisorConfig, readyz
from scheduler_svc.health import Health

# A stand-in role: the real probe server of services/http_probes.py on its own loop, its
# port in "<port file>.metrics" as every role writes it, then it serves until killed.
_ROLE = r"""
import asyncio, pathlib, sys
from services.http_probes import ProbeServer
from services.process import metrics_port_file, write_port_file
async def main():
    server = ProbeServer()
    server.set_readiness(lambda: {"ready": True})
    port = await server.start("127.0.0.1", 0)
    write_port_file(metrics_port_file(sys.argv[1]), port)
    pathlib.Path(sys.argv[1]).write_text("4242")
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _mesh(tmp_path: pathlib.Path, tiny_model_dir) -> launcher.Mesh:
    mesh = launcher.Mesh(launcher.MeshSpec(model_dir=str(tiny_model_dir), work_dir=str(tmp_path)))
    port_file = tmp_path / "gateway.port"
    cmd = [sys.executable, "-c", _ROLE, str(port_file)]
    mesh.roles.append(mesh._launch("gateway", cmd, port_file, tmp_path / "gateway.log"))
    mesh.roles[-1].port = mesh._wait_port(mesh.roles[-1], 60)
    return mesh


def test_a_frozen_role_is_killed_and_restarted(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(launcher, "STATE_FILE", tmp_path / "state.json")
    mesh = _mesh(tmp_path, tiny_model_dir)
    try:
        assert mesh.restart_exited() == []  # starts the supervisor
        config = mesh.supervisor.config
        first = mesh.roles[0].proc
        time.sleep(3 * config.interval_s)  # it answered once: known alive
        assert readyz(mesh.roles[0].metrics_port, 1.0) is Health.SERVING
        os.kill(first.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        first.wait(10)
        took = time.monotonic() - frozen_at
        low, high = config.detection_s
        assert low - 0.1 <= took <= high + 1.0, (took, config.detection_s)  # + slack for a loaded CI host
        assert first.returncode == -signal.SIGKILL and mesh.supervisor.killed == ["gateway"]
        assert mesh.restart_exited() == ["gateway"]
        assert mesh.roles[0].proc.pid != first.pid and mesh.roles[0].proc.poll() is None
    finally:
        mesh.stop(grace_s=1)


class _Role:
    def __init__(self, name: str, proc, metrics_port: int | None):
        self.name, self.proc, self.metrics_port = name, proc, metrics_port


class _Proc:
    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None


def test_silence_after_a_ready_answer_or_refusals_kill_and_late_answers_do_not(monkeypatch):
    killed = []
    monkeypatch.setattr(os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    answers = {1: Health.SERVING, 2: Health.NO_ANSWER, 3: Health.NOT_SERVING, 5: Health.SERVING, 6: Health.SERVING}

    def probe(port: int, deadline_s: float) -> Health:
        if port == 5:
            time.sleep(0.25)  # a loaded role: each answer comes far past the interval, but comes
        elif answers[port] is Health.NO_ANSWER:
            time.sleep(0.05)  # as a frozen process, up to a (short, here) deadline
        return answers[port]

    roles = [_Role("frozen", _Proc(10), 1), _Role("never-answered", _Proc(20), 2), _Role("loading", _Proc(30), 3),
             _Role("starting", _Proc(40), None), _Role("slow", _Proc(50), 5), _Role("gone", _Proc(60), 6)]
    config = SupervisorConfig(interval_s=0.05, refusals=2, silent_s=0.4, silent_not_ready_s=1.2)
    supervisor = Supervisor(lambda: roles, config, probe=probe)

    def judge_for(seconds: float) -> dict[str, float]:
        """Judges every 0.02 s for `seconds`; the roles killed, with when."""
        start, kills = time.monotonic(), {}
        while time.monotonic() - start < seconds:
            for name in supervisor.judge_once():
                kills[name] = time.monotonic() - start
            time.sleep(0.02)  # rounds more often than the interval: none is judged late
        return kills

    try:
        assert judge_for(0.5) == {}  # all answered once (but never-answered and starting)
        assert [supervisor.has_heard(role) for role in roles] == [True, False, True, False, True, True]
        answers.update({1: Health.NO_ANSWER, 3: Health.NO_ANSWER, 6: Health.REFUSED})
        kills = judge_for(2.0)
        assert set(kills) == {"frozen", "loading", "gone"}, kills
        assert kills["gone"] < kills["frozen"] < kills["loading"], kills
        assert 0.3 <= kills["frozen"] <= 1.0, kills  # silent_s after its last answer, + slack for a loaded host
        assert kills["loading"] >= 1.1, kills  # silent_not_ready_s
        assert sorted(killed) == [(10, signal.SIGKILL), (30, signal.SIGKILL), (60, signal.SIGKILL)]
    finally:
        supervisor.stop()


def test_a_role_that_never_answers_is_killed_after_its_allowance(monkeypatch):
    killed = []
    monkeypatch.setattr(os, "killpg", lambda pid, sig: killed.append((pid, sig)))

    def probe(port: int, deadline_s: float) -> Health:
        return Health.SERVING if port == 2 else Health.NO_ANSWER

    roles = [_Role("hung-at-start", _Proc(10), 1), _Role("live", _Proc(20), 2)]
    config = SupervisorConfig(interval_s=0.05, silent_s=0.4, silent_unheard_s=0.6)
    supervisor = Supervisor(lambda: roles, config, probe=probe)
    try:
        start, kills = time.monotonic(), {}
        while time.monotonic() - start < 1.5:
            for name in supervisor.judge_once():
                kills.setdefault(name, time.monotonic() - start)  # (a process that stays is killed again)
            time.sleep(0.02)
        assert set(kills) == {"hung-at-start"} and 0.5 <= kills["hung-at-start"] <= 1.2, kills
        assert killed[0] == (10, signal.SIGKILL) and set(killed) == {(10, signal.SIGKILL)}
    finally:
        supervisor.stop()


@pytest.mark.parametrize("kwargs", [dict(interval_s=0), dict(deadline_s=-1), dict(refusals=0),
                                    dict(silent_s=0), dict(silent_not_ready_s=0), dict(silent_unheard_s=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="supervisor needs"):
        SupervisorConfig(**kwargs)
