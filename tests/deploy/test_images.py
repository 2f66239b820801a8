"""deploy/images: the Dockerfile and its lock, checked statically (no docker
engine runs in CI): pinned bases, pinned installs, one entrypoint per role
that is the role's real module, torch at pyproject.toml's pin."""

import importlib
import pathlib
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.dockerfile import (
    DOCKERFILE, ROLE_MODULES, ROOT, entrypoint, pip_installs, root_image, split_pip_args, stages,
)

LOCK = ROOT / "deploy" / "images" / "requirements.txt"
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+$")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def all_stages():
    return stages(DOCKERFILE.read_text())


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert PINNED.match(line), f"{LOCK.name}: {line!r} is not name==version"
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def project_pin(name: str) -> str:
    for dep in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dep)
        if canonicalize_name(req.name) == name:
            (spec,) = req.specifier
            assert spec.operator == "==", f"pyproject.toml must pin {name} exactly, got {dep!r}"
            return spec.version
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


def test_base_images_are_pinned_by_version_tag(all_stages):
    for stage in all_stages.values():
        if stage.base in all_stages or stage.base == "scratch":
            continue
        image, _, digest = stage.base.partition("@")
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert digest.startswith("sha256:") or re.search(r"\d+\.\d+", tag), (
            f"stage {stage.name}: FROM {stage.base!r} is not pinned to a version tag")
        assert tag != "latest", stage.base


@pytest.mark.parametrize("target", sorted(ROLE_MODULES))
def test_each_role_target_runs_its_module(all_stages, target):
    module = ROLE_MODULES[target]
    assert target in all_stages, f"no build target {target!r} in {DOCKERFILE}"
    assert entrypoint(all_stages, target) == ["python", "-m", module]
    assert callable(importlib.import_module(module).main)


def test_the_expert_gpu_image_is_on_cuda_and_the_others_on_python_3_11(all_stages):
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d+\.\d+",
                        root_image(all_stages, "expert-cuda"))
    assert any("python3.11" in run for run in all_stages["expert-cuda"].values("RUN"))
    for target in ("gateway", "scheduler", "router", "expert-cpu"):
        assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", root_image(all_stages, target)), target
    assert PYPROJECT["project"]["requires-python"].startswith(">=3.11")


def copied_files(all_stages) -> dict[str, pathlib.Path]:
    """Path in the image -> file in the repo, for every COPY of one file."""
    result = {}
    for stage in all_stages.values():
        for argument in stage.values("COPY"):
            *sources, dest = argument.split()
            if len(sources) == 1 and not sources[0].startswith("--"):
                result[dest] = ROOT / sources[0]
    return result


def test_copy_sources_exist_and_reach_the_build_context(all_stages):
    ignore = DOCKERFILE.with_name("Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore, "the build context should hold only what the images need"
    for stage in all_stages.values():
        for argument in stage.values("COPY"):
            *sources, _dest = argument.split()
            if sources[0].startswith("--from="):
                assert sources[0].removeprefix("--from=") in all_stages, argument
                continue
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such path in the repo"
                assert f"!{source}" in ignore or f"!{source}/**" in ignore, (
                    f"COPY {source}: excluded from the build context by Dockerfile.dockerignore")


def test_every_pip_install_is_pinned(all_stages):
    copied = copied_files(all_stages)
    num_calls = 0
    for stage in all_stages.values():
        for run in stage.values("RUN"):
            for args in pip_installs(run):
                num_calls += 1
                flags, files, specs = split_pip_args(args)
                for spec in specs:
                    if spec.startswith(("/", ".")):
                        assert "--no-deps" in flags, f"{stage.name}: pip install {spec} pulls unpinned deps"
                    else:
                        assert PINNED.match(spec), f"{stage.name}: pip install {spec!r} is not pinned"
                for path in files:
                    assert path in copied, f"{stage.name}: -r {path} is not a file COPY'd from the repo"
                    assert copied[path] == LOCK
                    lock_pins()  # asserts every line is name==version
    assert num_calls >= 4


def test_both_torch_builds_are_pyproject_pin(all_stages):
    torch_pin = project_pin("torch")
    torch_specs = {}  # every torch install of each target, not only its last
    for target in ("cpu", "expert-cuda"):
        for run in all_stages[target].values("RUN"):
            for args in pip_installs(run):
                _flags, _files, specs = split_pip_args(args)
                torch_specs.setdefault(target, set()).update(s for s in specs if s.startswith("torch=="))
    assert torch_specs == {"cpu": {f"torch=={torch_pin}+cpu"}, "expert-cuda": {f"torch=={torch_pin}"}}


def test_the_lock_covers_every_dependency_of_pyproject():
    pins = lock_pins()
    assert "torch" not in pins, "torch is installed per target, not from the lock"
    for dep in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"{name} is missing from {LOCK}: run deploy/images/lock.py"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name]}, pyproject.toml asks {dep!r}: run deploy/images/lock.py")
