"""bench/gpu_session.sh names only modules and files that exist: a moved benchmark or test
would otherwise fail only on the lent GPU machine, after the device time is spent."""

import importlib.util
import pathlib
import re

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
