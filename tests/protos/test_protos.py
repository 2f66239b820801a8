"""The contracts: buf lint (STANDARD), no breaking change against the
committed baseline image, and generated stubs in step with the protos."""

import pathlib
import shutil
import subprocess
import sys

import pytest

from moemesh import protogen

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUF = shutil.which("buf", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("buf")


def run_buf(*args: str) -> subprocess.CompletedProcess:
    assert BUF, "the buf binary (package buf-bin) is not installed"
    return subprocess.run([BUF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_buf_lint_is_clean():
    result = run_buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_breaking_change_against_baseline():
    result = run_buf("breaking", "--against", "protos/baseline.binpb")
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_stubs_are_fresh():
    assert protogen.stale_stubs() == []


def test_stale_stub_is_detected(tmp_path):
    tree = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", tree)
    stub = tree / "moe" / "gateway" / "v1" / "gateway_pb2.py"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    (tree / "moe" / "router" / "v1" / "router_pb2_grpc.py").unlink()
    problems = protogen.stale_stubs(tree)
    assert "stale: moe/gateway/v1/gateway_pb2.py" in problems
    assert "missing: moe/router/v1/router_pb2_grpc.py" in problems


def test_lint_catches_a_bad_proto(tmp_path):
    """The lint check can fail: a service without the Service suffix is refused."""
    (tmp_path / "buf.yaml").write_text((ROOT / "buf.yaml").read_text())
    bad = tmp_path / "protos" / "moe" / "bad" / "v1"
    bad.mkdir(parents=True)
    (bad / "bad.proto").write_text(
        'syntax = "proto3";\npackage moe.bad.v1;\nservice Bad { rpc Do(DoRequest) returns (DoResponse); }\n'
        "message DoRequest {}\nmessage DoResponse {}\n"
    )
    result = subprocess.run([BUF, "lint"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Bad" in result.stdout + result.stderr
