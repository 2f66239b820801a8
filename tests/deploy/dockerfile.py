"""A small static reader of deploy/images/Dockerfile: stages, base images,
entrypoints, RUN commands and the pip installs in them (no docker engine
runs in CI, so the image definition is checked as text)."""

import dataclasses
import json
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "images" / "Dockerfile"
# The image of each role's build target, as the manifests name it (moemesh/<target>).
ROLE_MODULES = {
    "gateway": "gateway.main",
    "scheduler": "scheduler_svc.main",
    "router": "router_svc.main",
    "expert-cpu": "expert_svc.main",
    "expert-cuda": "expert_svc.main",
}


@dataclasses.dataclass(slots=True)
class Stage:
    """One FROM ... AS name section."""

    name: str
    base: str  # an image reference, or the name of an earlier stage
    instructions: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def values(self, keyword: str) -> list[str]:
        return [value for kw, value in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, argument) pairs, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    pairs = []
    for line in joined:
        keyword, _, argument = line.strip().partition(" ")
        pairs.append((keyword.upper(), argument.strip()))
    return pairs


def stages(text: str) -> dict[str, Stage]:
    """The stages by name, in order."""
    result: dict[str, Stage] = {}
    current = None
    for keyword, argument in instructions(text):
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", argument, re.I)
            assert match, f"cannot read FROM {argument!r}"
            current = Stage(name=match.group(2) or f"stage{len(result)}", base=match.group(1))
            result[current.name] = current
        elif current is not None:
            current.instructions.append((keyword, argument))
    return result


def chain(all_stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and its ancestors, the stage itself first."""
    result = [all_stages[name]]
    while result[-1].base in all_stages:
        result.append(all_stages[result[-1].base])
    return result


def entrypoint(all_stages: dict[str, Stage], name: str) -> list[str] | None:
    """The ENTRYPOINT (exec form) a target ends up with, inherited or its own."""
    for stage in chain(all_stages, name):
        if stage.values("ENTRYPOINT"):
            return json.loads(stage.values("ENTRYPOINT")[-1])
    return None


def root_image(all_stages: dict[str, Stage], name: str) -> str:
    """The external image a target is built on."""
    return chain(all_stages, name)[-1].base


def pip_installs(run_command: str) -> list[list[str]]:
    """The arguments after `pip install` of each pip call in a RUN command."""
    calls = []
    for part in re.split(r"&&|;", run_command):
        words = shlex.split(part)
        for i in range(len(words) - 1):
            if words[i] in ("pip", "pip3") and words[i + 1] == "install":
                calls.append(words[i + 2:])
                break
            if words[i].endswith("python") and words[i + 1:i + 4] == ["-m", "pip", "install"]:
                calls.append(words[i + 4:])
                break
    return calls


_TAKES_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url"}


def split_pip_args(args: list[str]) -> tuple[set[str], list[str], list[str]]:
    """(flags, requirement files, requirement specs or paths) of one pip install."""
    flags, files, specs = set(), [], []
    it = iter(args)
    for arg in it:
        if arg in _TAKES_VALUE:
            value = next(it)
            if arg in ("-r", "--requirement"):
                files.append(value)
            flags.add(arg)
        elif arg.startswith("-"):
            flags.add(arg.split("=")[0])
        else:
            specs.append(arg)
    return flags, files, specs
