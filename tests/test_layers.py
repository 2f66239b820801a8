"""The layers of the code hold: the import contracts, no import cycles, and no torch in the control plane.

The contracts are pyproject.toml's [tool.importlinter] (`lint-imports` runs
them too); these tests run them in a subprocess, on this tree and on a copy
with deliberately wrong imports. A root package listed there that does not
exist is left out (`tools` is optional, like its layer).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROOT_PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]

# Runs the contracts of ./pyproject.toml over the packages on sys.path; exit status 1 if one is broken.
LINT = """
import importlib.util, sys
import importlinter.api  # configures import-linter
from importlinter.application import rendering, use_cases

options = use_cases.read_user_options("pyproject.toml")
roots = options.session_options["root_packages"]
options.session_options["root_packages"] = [p for p in roots if importlib.util.find_spec(p) is not None]
use_cases._register_contract_types(options)
report = use_cases.create_report(options, cache_dir=None)
rendering.render_report(report)
sys.exit(1 if report.contains_failures else 0)
"""


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    """The contracts over the packages under root (protos/ holds `moe`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "protos")])}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def existing_packages() -> list[str]:
    return [name for name in ROOT_PACKAGES if (ROOT / name).is_dir() or (ROOT / "protos" / name).is_dir()]


def test_the_import_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "KEPT" in result.stdout


# Deliberately wrong imports: (module, the import added, the contract it breaks, the violation reported).
WRONG_IMPORTS = [
    # The library imports a role; a role another role; a role the tooling; the protos the library.
    ("services/placement.py", "import gateway", "bench > tooling > roles", "services.placement -> gateway"),
    ("router_svc/policy.py", "import scheduler_svc.planner", "bench > tooling > roles",
     "router_svc.policy -> scheduler_svc.planner"),
    ("scheduler_svc/election.py", "from moemesh import launcher", "bench > tooling > roles",
     "scheduler_svc.election -> moemesh.launcher"),
    ("protos/moe/__init__.py", "import services", "bench > tooling > roles", "moe -> services"),
    # A logic module speaks gRPC itself.
    ("router_svc/autoscaler.py", "import grpc", "no gRPC, no protobuf", "router_svc.autoscaler -> grpc"),
    ("gateway/engine.py", "from moe.expert.v1 import expert_pb2", "no gRPC, no protobuf", "gateway.engine -> moe"),
    # The step contract pulls in torch.
    ("services/step.py", "import torch", "torch-free", "services.step -> torch"),
]


def test_wrong_imports_break_the_contracts(tmp_path):
    """A copy of the Python files with the wrong imports added: every one is reported."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for name in existing_packages():
        source = ROOT / name if (ROOT / name).is_dir() else ROOT / "protos" / name
        for path in source.rglob("*.py"):
            target = tmp_path / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    for module, wrong_import, _, _ in WRONG_IMPORTS:
        with open(tmp_path / module, "a") as file:
            file.write(f"\n{wrong_import}  # deliberately wrong\n")
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for _, _, contract, reported in WRONG_IMPORTS:
        [line] = [l for l in result.stdout.splitlines() if contract in l and ("KEPT" in l or "BROKEN" in l)]
        assert "BROKEN" in line, result.stdout
        assert reported in result.stdout, result.stdout


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def test_strongly_connected_finds_a_cycle():
    """The cycle finder itself, on a copy with one module importing back."""
    graph = grimp.ImportGraph()
    for importer, imported in [("a.x", "a.y"), ("a.y", "a.z"), ("a.z", "a.x"), ("a.z", "a.w")]:
        graph.add_import(importer=importer, imported=imported)
    assert strongly_connected(graph) == [["a.x", "a.y", "a.z"]]


def test_no_import_cycles():
    graph = grimp.build_graph(*existing_packages(), cache_dir=None)
    assert strongly_connected(graph) == []


@pytest.mark.parametrize("module", ["router_svc.main", "scheduler_svc.main"])
def test_the_control_plane_starts_without_torch(module):
    script = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_module_has_its_row_in_the_ownership_table():
    """docs/internals.md's ownership table names every module of the library, the roles and the tooling."""
    table = (ROOT / "docs" / "internals.md").read_text()
    modules = [path.relative_to(ROOT).as_posix()
               for name in ("services", "gateway", "expert_svc", "router_svc", "scheduler_svc", "moemesh")
               for path in sorted((ROOT / name).rglob("*.py"))
               if path.name != "__init__.py" or path.stat().st_size]
    missing = [module for module in modules if f"| `{module}` |" not in table]
    assert not missing, f"modules without a row in docs/internals.md's ownership table: {missing}"
