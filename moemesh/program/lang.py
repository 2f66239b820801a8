"""What a program is written with: `gen`, `select`, `bind`, the chat roles, and `@moemesh.function`.

These are plain values describing a step; `s += value` (state.py) turns each
into a node of the run's DAG (runtime.py). Nothing here talks to the gateway.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

NORMALIZATIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True, slots=True)
class Gen:
    """Generate text into the variable `name`; `s[name]` is the text, or the parsed JSON with json_schema."""

    name: str
    max_tokens: int = 128
    stop: str | Sequence[str] = ()
    temperature: float = 0.0
    regex: str | None = None
    json_schema: str | Mapping | None = None
    choices: Sequence[str] | None = None
    # Any other SamplingOptions of the client (seed, top_p, top_k, ignore_eos, ...).
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def sampling(self) -> dict[str, Any]:
        """The client's keyword arguments for this generation."""
        options = dict(max_new_tokens=self.max_tokens, stop=self.stop, temperature=self.temperature,
                       regex=self.regex, json_schema=self.json_schema,
                       choice=None if self.choices is None else list(self.choices), **self.options)
        return {key: value for key, value in options.items() if value is not None}


@dataclasses.dataclass(frozen=True, slots=True)
class Select:
    """Pick the most likely of `choices` given the state, into the variable `name`.

    Every choice is scored by the log-probability of its tokens after the
    state's tokens: `normalize="mean"` (the default) averages over the
    choice's tokens, so longer choices are not penalised for their length;
    "sum" is the plain log-likelihood. Ties go to the earlier choice.
    """

    name: str
    choices: Sequence[str]
    normalize: str = "mean"

    def __post_init__(self) -> None:
        if isinstance(self.choices, str) or not self.choices or not all(self.choices):
            raise ValueError(f"select {self.name!r}: choices must be non-empty texts, got {self.choices!r}")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"select {self.name!r}: choices must differ, got {self.choices!r}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"select {self.name!r}: normalize must be one of {NORMALIZATIONS}, "
                             f"got {self.normalize!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Bind:
    """A Python function (sync or async) as a node; a keyword argument that is a Ref waits for that node."""

    tool: Callable[..., Any]
    args: Mapping[str, Any]
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Role:
    """A chat message: its content is text, or a sequence of texts, refs and gen/select/bind steps."""

    role: str
    content: tuple


class ProgramError(Exception):
    """A program run failed: `node` (of `kind` gen, select, tool, ...) raised `__cause__`.

    `aborted` names the nodes whose in-flight requests the failure ended through Abort.
    """

    def __init__(self, program: str, node: str, kind: str, error: BaseException) -> None:
        super().__init__(f"program {program!r}: {kind} node {node!r} failed: {type(error).__name__}: {error}")
        self.program, self.node, self.kind = program, node, kind
        self.aborted: tuple[str, ...] = ()


class GenerationAborted(Exception):
    """A gen's request ended with finish_reason "abort" (someone called Abort on it)."""


def gen(name: str, max_tokens: int = 128, *, stop: str | Sequence[str] = (), temperature: float = 0.0,
        regex: str | None = None, json_schema: str | Mapping | None = None, choices: Sequence[str] | None = None,
        **options: Any) -> Gen:
    """A generation step; at most one of regex, json_schema, choices constrains it (the gateway enforces it)."""
    constraints = [key for key, value in (("regex", regex), ("json_schema", json_schema), ("choices", choices))
                   if value is not None]
    if len(constraints) > 1:
        raise ValueError(f"gen {name!r}: at most one of regex, json_schema, choices, got {constraints}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"gen {name!r}: max_tokens must be a positive integer, got {max_tokens!r}")
    return Gen(name, max_tokens, stop, temperature, regex, json_schema, choices, options)


def select(name: str, choices: Sequence[str], *, normalize: str = "mean") -> Select:
    """A choice among texts by likelihood (Select says how they are scored)."""
    return Select(name, choices if isinstance(choices, str) else tuple(choices), normalize)


def bind(tool: Callable[..., Any], /, **args: Any) -> Bind:
    """`tool(**args)` as a node named after the tool; Ref arguments are replaced by those nodes' values."""
    return Bind(tool, args, getattr(tool, "__name__", "tool"))


def _role(role: str):
    def make(*content) -> Role:
        return Role(role, content)
    make.__name__ = role
    make.__doc__ = f"A {role} message, rendered by the gateway's chat template."
    return make


system, user, assistant = _role("system"), _role("user"), _role("assistant")


class Program:
    """A function of the program state `s`; `run` executes it once, `run_batch` many times concurrently."""

    def __init__(self, body: Callable[..., None]) -> None:
        functools.update_wrapper(self, body)
        self.body = body
        self.name = body.__name__

    def run(self, *args: Any, runtime, **kwargs: Any):
        """Runs the program to the end and returns its State; ProgramError names the failing node."""
        return runtime.run(self, args, kwargs)

    async def arun(self, *args: Any, runtime, **kwargs: Any):
        """`run` from inside an event loop."""
        return await runtime.arun(self, args, kwargs)

    def run_batch(self, batch: Sequence[Mapping[str, Any]], *, runtime, max_concurrency: int = 8,
                  progress: bool = False, return_exceptions: bool = False) -> list:
        """Runs the program once per keyword-argument mapping, at most max_concurrency at a time.

        The States in the batch's order; a failed run raises its ProgramError
        once the batch has finished, or stands in its place with return_exceptions.
        """
        return runtime.run_batch(self, batch, max_concurrency=max_concurrency, progress=progress,
                                 return_exceptions=return_exceptions)


def function(body: Callable[..., None]) -> Program:
    """Decorator: a program whose first argument is the state `s`."""
    return Program(body)
