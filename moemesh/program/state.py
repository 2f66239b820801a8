"""The program state `s`: an ordered list of pieces (token ids to be), the variables, forks.

`s += x` never waits: it hands x to the run (runtime.py), which returns a
future for the piece, and appends it. A piece is text, a chat message, a
node's output (gen, select, bind) or a ref's value; a gen or select waits for
every piece before it (its prompt), a bind only for its Ref arguments. Only
reading a value (`s[name]`, `s.text()`) blocks the program until it is there.

The prompt is token ids, never re-tokenized text: each piece is tokenized
once (chat messages through the gateway's chat template) and a gen's output
joins as the ids it generated, so a later request starts with exactly the
tokens the earlier one had, and the prefix cache finds them.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
from typing import Any

from moemesh.program.lang import Bind, Gen, Role, Select


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Part of a state's prompt."""

    token_ids: tuple[int, ...]
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class NodeOutput:
    """What a gen, select or bind node produced."""

    name: str
    kind: str
    # gen: the text, or the parsed JSON with json_schema; select: the choice; bind: the tool's return value.
    value: Any
    # As it joins the prompt (a bind's value as text: JSON for dicts and lists).
    text: str
    token_ids: tuple[int, ...] = ()
    # The client's Usage of a gen's request (a select's: its requests' summed); None for bind.
    usage: Any = None
    # select only: each choice's score (Select's normalisation).
    scores: dict[str, float] | None = None
    request_ids: tuple[str, ...] = ()
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """A node's value to be, usable as a bind argument or appended to a state; `ref[key]` indexes into it."""

    future: cf.Future
    keys: tuple = ()

    def __getitem__(self, key) -> Ref:
        return Ref(self.future, (*self.keys, key))

    def resolve(self, output: NodeOutput) -> Any:
        return self.index(output.value)

    def index(self, value: Any, start: int = 0) -> Any:
        """value indexed by the keys from keys[start] on."""
        for key in self.keys[start:]:
            try:
                value = value[key]
            except (KeyError, IndexError, TypeError) as error:
                raise LookupError(f"a reference's [{key!r}]: the value has no such key, it is the "
                                  f"{type(value).__name__} {repr(value)[:80]}") from error
        return value


def as_text(value: Any) -> str:
    """How a value joins a prompt: text as is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


class State:
    """The state of one program run (or a fork of it)."""

    def __init__(self, run, pieces: list[cf.Future] | None = None, variables: dict[str, cf.Future] | None = None):
        self._run = run
        self._pieces: list[cf.Future] = pieces or []
        self._variables: dict[str, cf.Future] = variables or {}

    def __iadd__(self, item) -> State:
        if isinstance(item, Role):
            self._add_role(item)
        else:
            self._add(item)
        return self

    def __getitem__(self, name: str) -> Any:
        """A variable's value, waiting for its node; the node's ProgramError if it failed."""
        return self.node(name).value

    def __contains__(self, name: str) -> bool:
        return name in self._variables

    def node(self, name: str) -> NodeOutput:
        """Everything the node that set the variable produced (usage, request ids, select's scores)."""
        if name not in self._variables:
            raise KeyError(f"no variable {name!r} in this state; it has {sorted(self._variables)}")
        return self._variables[name].result()

    def ref(self, name: str) -> Ref:
        """The variable's value to be, without waiting (for bind arguments or `s += ref`)."""
        if name not in self._variables:
            raise KeyError(f"no variable {name!r} in this state; it has {sorted(self._variables)}")
        return Ref(self._variables[name])

    def fork(self, n: int) -> list[State]:
        """n states that continue this one independently; their requests share its prefix in the cache.

        The forks' requests go out as soon as their own inputs are ready: the
        gateway computes a prefix they share once (the first request to reach
        it prefills it; the others wait a step for its blocks and reuse them).
        """
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        return [State(self._run, list(self._pieces), dict(self._variables)) for _ in range(n)]

    def text(self) -> str:
        """The state's text so far (a chat message counts as its content), waiting for every piece."""
        return "".join(piece.result().text for piece in self._pieces)

    def token_ids(self) -> list[int]:
        """The state's prompt as token ids, waiting for every piece."""
        return [token for piece in self._pieces for token in piece.result().token_ids]

    def run_nodes(self) -> list[NodeOutput]:
        """Every finished node of the run, of any of its states, in the order they finished."""
        return list(self._run.outputs)

    def variables(self) -> dict[str, Any]:
        """Every variable's value, waiting for all."""
        return {name: future.result().value for name, future in self._variables.items()}

    def _add(self, item) -> None:
        run = self._run
        if isinstance(item, str):
            self._pieces.append(run.text_piece(item))
        elif isinstance(item, Ref):
            self._pieces.append(run.ref_piece(item))
        elif isinstance(item, (Gen, Select)):
            future = (run.gen if isinstance(item, Gen) else run.select)(item, list(self._pieces))
            self._set(item.name, future)
        elif isinstance(item, Bind):
            self._set(item.name, run.tool(item))
        else:
            raise TypeError(f"cannot add {type(item).__name__} to a program state: {item!r}")

    def _set(self, name: str, future: cf.Future) -> None:
        self._pieces.append(future)
        self._variables[name] = future

    def _add_role(self, role: Role) -> None:
        if all(isinstance(part, str) for part in role.content):
            self._pieces.append(self._run.message_piece(role.role, "".join(role.content)))
            return
        # A message with steps inside: the template's opening, the parts, its closing.
        opening, closing = self._run.role_markers(role.role)
        self._pieces.append(opening)
        for part in role.content:
            self._add(part)
        self._pieces.append(closing)
