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


def test_every_pattern_the_session_runs_matches_files():
    """A glob (the test step's tests/expert_svc/*_cuda.py) that matched nothing would reach pytest as is."""
    commands = "\n".join(line for line in SCRIPT.splitlines() if not line.lstrip().startswith("#"))
    patterns = set(re.findall(r"\b((?:bench|tests)/[\w/]*\*[\w*]*\.py)\b", commands))
    assert "tests/expert_svc/*_cuda.py" in patterns
    matched = {p: sorted(str(f.relative_to(ROOT)) for f in ROOT.glob(p)) for p in patterns}
    assert not [p for p, files in matched.items() if not files], matched
    assert {"tests/expert_svc/test_pipeline_cuda.py", "tests/expert_svc/test_logprobs_cuda.py"} <= set(
        matched["tests/expert_svc/*_cuda.py"])
