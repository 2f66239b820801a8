"""The README's first command, run as a user would: it serves a request,
restarts an expert service that crashed (serving again once the group is
re-formed) and shuts down on SIGTERM."""

import json
import os
import pathlib
import re
import signal
import subprocess
import time

import grpc

from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_first_two_commands_are_up_and_test():
    first, second = readme_commands()[:2]
    assert first == "bash scripts/up.sh"
    assert second == "bash scripts/test.sh"
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_first_readme_command_serves_and_stops_cleanly(tmp_path):
    command = readme_commands()[0].split() + ["--port", "0", "--http-port", "0", "--work-dir", str(tmp_path / "mesh")]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        deadline = time.monotonic() + 300
        address = None
        while address is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            match = re.search(r"gateway at (\S+)", line)
            address = match and match.group(1)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            request = gateway_pb2.GenerateRequest(request_id="readme", prompt="Hello, world!",
                                                  sampling=gateway_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True))
            responses = list(stub.Generate(request, timeout=120))
        assert sum(len(r.token_ids) for r in responses) == 8
        assert responses[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        # A crashed expert service is restarted, the scheduler re-forms its group and serving resumes.
        expert_pid = json.loads((tmp_path / "mesh" / "mesh.json").read_text())["pids"]["expert-0"]
        os.kill(expert_pid, signal.SIGKILL)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            again = _generate_once_served(stub, request, timeout_s=180)
        assert sum(len(r.token_ids) for r in again) == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "expert-0 exited; restarted it" in output, output
    assert "stopped" in output, output


def _generate_once_served(stub, request, timeout_s: float) -> list:
    """The request's responses once the gateway serves it again (UNAVAILABLE while no group is ready)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(stub.Generate(request, timeout=60))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
