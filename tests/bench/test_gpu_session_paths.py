"""bench/gpu_session.sh names only modules and files that exist, and every step's arguments
parse (the benchmark's, the services' it hands on, a test selection that selects tests): a
moved benchmark or a misspelt flag would otherwise fail only on the lent GPU machine, after the
device time is spent."""

import argparse
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys
import types

import pytest
import torch

from expert_svc.config import ExpertConfig
from gateway.config import GatewayConfig
from services.settings import parse_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "bench" / "gpu_session.sh").read_text()


def test_every_module_the_session_runs_exists():
    modules = set(re.findall(r"python3 -m (bench\.[\w.]+)", SCRIPT))
    assert {"bench.accuracy.hf_parity", "bench.serving.gpu_speed"} <= modules  # the parity and n1 steps
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, missing


def test_every_file_the_session_runs_exists():
    commands = "\n".join(line for line in SCRIPT.splitlines() if not line.lstrip().startswith("#"))
    paths = set(re.findall(r"\b((?:bench|tests)/[\w/]+\.py)\b", commands))
    assert any(p.startswith("tests/") for p in paths) and any(p.startswith("bench/") for p in paths)
    missing = [p for p in sorted(paths) if not (ROOT / p).is_file()]
    assert not missing, missing


def test_every_pattern_the_session_runs_matches_files():
    """A glob (the test step's tests/expert_svc/*_cuda.py) that matched nothing would reach pytest as is."""
    commands = "\n".join(line for line in SCRIPT.splitlines() if not line.lstrip().startswith("#"))
    patterns = set(re.findall(r"\b((?:bench|tests)/[\w/]*\*[\w*]*\.py)\b", commands))
    assert "tests/expert_svc/*_cuda.py" in patterns
    matched = {p: sorted(str(f.relative_to(ROOT)) for f in ROOT.glob(p)) for p in patterns}
    assert not [p for p, files in matched.items() if not files], matched
    assert {"tests/expert_svc/test_pipeline_cuda.py", "tests/expert_svc/test_logprobs_cuda.py"} <= set(
        matched["tests/expert_svc/*_cuda.py"])


class _Parsed(Exception):
    """Raised in place of a benchmark's work once its arguments have parsed."""


def session_commands(steps: str, **env: str) -> list[list[str]]:
    """Every part's command of `steps`, as bash expands it (GPU_SESSION_DRY=1 prints them)."""
    environ = {"PATH": os.environ["PATH"], "GPU_SESSION_DRY": "1", "STEPS": steps, **env}
    out = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=environ, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def _load(argv: list[str]) -> tuple[types.ModuleType, list[str]]:
    """The module a `python3 -m M ...` or `python3 FILE ...` command runs, and its arguments."""
    if argv[0] == "-m":
        return importlib.import_module(argv[1]), argv[2:]
    spec = importlib.util.spec_from_file_location(f"gpu_session_{pathlib.Path(argv[0]).stem}", ROOT / argv[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, argv[1:]


def check_arguments(argv: list[str], monkeypatch) -> None:
    """The benchmark's own parser (and its checks) accepts the arguments, without running it; the
    checks see the GPUs the lent machine has, not this one's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    module, args = _load(argv)
    if hasattr(module, "parse_args"):
        module.parse_args(args)
        return
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        parse(self, *a, **kw)
        raise _Parsed
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [argv[0], *args])
    with pytest.raises(_Parsed):
        module.main(args) if inspect.signature(module.main).parameters else module.main()


ALL_STEPS = " ".join(re.findall(r"^ {8}([a-z0-9]+)\)", SCRIPT, flags=re.M))


def test_every_step_parses_its_arguments(monkeypatch):
    """A misspelt option or a bad default would otherwise fail only on the lent GPU machine."""
    commands = {}  # each distinct command once, over the one- and the two-GPU kind
    for kind in ("nvidia-h200", "nvidia-h200-x2"):
        kind_commands = session_commands(ALL_STEPS, KIND=kind)
        assert len(kind_commands) > len(ALL_STEPS.split()) > 30
        commands.update((shlex.join(command), command) for command in kind_commands)
    for command in commands.values():
        assert command[0] == "python3", command
        if command[1:3] == ["-m", "pytest"]:
            # The CUDA tests skip on the CPU but collect; a -k that selects none would exit 5 there.
            collect = subprocess.run([sys.executable, *command[1:], "--collect-only", "-q"], cwd=ROOT,
                                     capture_output=True, text=True, timeout=300)
            assert collect.returncode == 0, (command, collect.stdout[-2000:], collect.stderr[-2000:])
            continue
        try:
            check_arguments(command[1:], monkeypatch)
            check_service_arguments(command, monkeypatch)
        except SystemExit as error:  # argparse's refusal
            pytest.fail(f"{shlex.join(command)}: exit {error.code}")
        monkeypatch.undo()


def check_service_arguments(command: list[str], monkeypatch) -> None:
    """The flags a serving benchmark hands on to the expert services and the gateway
    (--expert-arg=, --gateway-arg=) parse with those services' own settings, on a CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    expert = [arg.removeprefix("--expert-arg=") for arg in command if arg.startswith("--expert-arg=")]
    gateway = [arg.removeprefix("--gateway-arg=") for arg in command if arg.startswith("--gateway-arg=")]
    if expert:
        parse_config(ExpertConfig, ["--member-id", "e0", "--model", "/model", "--device", "cuda", *expert],
                     prog="expert_svc")
    if gateway:
        demo = str(ROOT / "services" / "model" / "demo")
        parse_config(GatewayConfig, ["--member-id", "g0", "--model", demo, *gateway], prog="gateway")
