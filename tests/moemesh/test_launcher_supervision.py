"""Mesh.restart_exited, the supervision `moemesh up` runs: an exited role starts
again with its first command; a crash loop is refused."""

import pathlib
import sys

import pytest

from moemesh import launcher

# A stand-in role (named "gateway", which the mesh state file needs): reports a port in its port file, then exits with argv[2] after argv[3] seconds.
_ROLE = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('4242'); "
         "time.sleep(float(sys.argv[3])); sys.exit(int(sys.argv[2]))")


def _mesh_with_role(tmp_path: pathlib.Path, tiny_model_dir, exit_code: int, after_s: float) -> launcher.Mesh:
    mesh = launcher.Mesh(launcher.MeshSpec(model_dir=str(tiny_model_dir), work_dir=str(tmp_path)))
    port_file = tmp_path / "gateway.port"
    cmd = [sys.executable, "-c", _ROLE, str(port_file), str(exit_code), str(after_s)]
    mesh.roles.append(mesh._launch("gateway", cmd, port_file, tmp_path / "gateway.log"))
    mesh.roles[-1].port = mesh._wait_port(mesh.roles[-1], 30)
    return mesh


def test_an_exited_role_is_restarted_with_its_command(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(launcher, "STATE_FILE", tmp_path / "state.json")
    mesh = _mesh_with_role(tmp_path, tiny_model_dir, exit_code=4, after_s=0.5)
    first = mesh.roles[0].proc
    first.wait(10)
    assert mesh.restart_exited() == ["gateway"]
    assert mesh.roles[0].proc.pid != first.pid and mesh.roles[0].cmd == first.args
    assert mesh.roles[0].port == 4242
    mesh.stop(grace_s=1)


def test_a_crash_loop_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(launcher, "STATE_FILE", tmp_path / "state.json")
    mesh = _mesh_with_role(tmp_path, tiny_model_dir, exit_code=1, after_s=0.5)
    try:
        for _ in range(launcher.MAX_RESTARTS_PER_WINDOW):
            mesh.roles[0].proc.wait(10)
            assert mesh.restart_exited() == ["gateway"]
        mesh.roles[0].proc.wait(10)
        with pytest.raises(RuntimeError, match=r"gateway exited with 1 after 5 restarts"):
            mesh.restart_exited()
    finally:
        mesh.stop(grace_s=1)


def test_running_roles_are_left_alone(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(launcher, "STATE_FILE", tmp_path / "state.json")
    mesh = _mesh_with_role(tmp_path, tiny_model_dir, exit_code=0, after_s=30)
    try:
        assert mesh.restart_exited() == []
    finally:
        mesh.stop(grace_s=1)


@pytest.mark.parametrize("nice", [0, 7])
def test_the_data_plane_runs_niced_and_the_schedulers_do_not(tmp_path, tiny_model_dir, monkeypatch, nice):
    """data_plane_nice: router, experts and gateways start under `nice`, with the niceness set
    before exec (every thread has it); schedulers at the launcher's priority."""
    if launcher.shutil.which("nice") is None:
        pytest.skip("no nice(1) here")
    mesh = launcher.Mesh(launcher.MeshSpec(model_dir=str(tiny_model_dir), work_dir=str(tmp_path),
                                           data_plane_nice=nice))
    launched = {}
    def launch(name, cmd, port_file, log_path):
        launched[name] = cmd
        return launcher.Role(name=name, proc=None, port_file=port_file, log_path=log_path, cmd=cmd)

    monkeypatch.setattr(mesh, "_launch", launch)
    monkeypatch.setattr(mesh, "_wait_port", lambda role, timeout_s: 0)
    monkeypatch.setattr(launcher.etcd, "start_etcd", lambda work_dir: type("E", (), {"endpoint": "x:1"}))
    mesh.roles = []
    mesh._start_all()
    niced = {name for name, cmd in launched.items() if cmd[:3] == ["nice", "-n", str(nice)]}
    assert {name for name in launched if name.startswith("scheduler")} == {"scheduler-0", "scheduler-1", "scheduler-2"}
    assert niced == (set() if nice == 0 else {"router", "expert-0", "gateway"})
    with pytest.raises(ValueError, match="within 0..19"):
        launcher.MeshSpec(model_dir=str(tiny_model_dir), data_plane_nice=-1)
