"""Every name the code uses is defined: pyflakes over the whole tree, undefined names only.

Much of the code never runs in the CPU suite (CUDA-only paths, the GPU
benchmarks), so a name used there without an import would first fail on a
GPU. pyflakes reads the source without running it.
"""

import pathlib

import pyflakes.api
import pyflakes.messages
import pyflakes.reporter

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "expert_svc", "router_svc", "scheduler_svc", "services", "moemesh", "bench", "tools",
            "examples", "tests")
UNDEFINED = (pyflakes.messages.UndefinedName, pyflakes.messages.UndefinedLocal, pyflakes.messages.UndefinedExport)


class _Collect(pyflakes.reporter.Reporter):
    """Keeps pyflakes' messages about undefined names and its syntax errors; drops the rest."""

    def __init__(self):
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802 - pyflakes' name
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:  # noqa: N802 - pyflakes' name
        self.found.append(f"{filename}: {msg}")


def _undefined(paths) -> list[str]:
    reporter = _Collect()
    for path in paths:
        pyflakes.api.checkPath(str(path), reporter)
    return reporter.found


def test_no_module_uses_an_undefined_name():
    paths = [p for package in PACKAGES if (ROOT / package).is_dir() for p in sorted((ROOT / package).rglob("*.py"))
             if ".venv" not in p.parts]
    assert len(paths) > 100
    assert _undefined(paths) == []


def test_the_check_finds_a_name_used_without_its_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def f(step):\n    metrics.observe(step)\n")
    assert [m.split(": ", 1)[-1] for m in _undefined([path])] == ["undefined name 'metrics'"]
