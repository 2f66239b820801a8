"""A JSON gen's top-level fields as they stream in, so that a Ref to one resolves before the gen ends.

`s.ref("fields")["order_id"]` names one field of a json_schema gen's object.
The gen streams its text (runtime: run.py), and each time a top-level
property's value is complete (the `,` or `}` after it, outside strings)
`PartialFields` parses it and wakes whoever waits for it: a tool bound to the
order id starts while the rest of the object is still being generated. The
value is the one the whole object's json.loads gives; a field that never
completes (the gen failed or the key is absent) is resolved from the node's
own output instead, which raises as it would without streaming.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

# PartialFields.wait's answer when the node ended first.
MISSING = object()


def complete_fields(text: str) -> dict[str, Any]:
    """The top-level properties of a JSON object's text (a prefix of it) whose values are complete."""
    fields: dict[str, Any] = {}
    if not text.lstrip().startswith("{"):
        return fields
    depth, in_string, escape = 0, False, False
    key, key_start, value_start = None, None, None
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                if depth == 1 and key is None and value_start is None:
                    key = json.loads(text[key_start:i + 1])
            continue
        if ch == '"':
            in_string = True
            if depth == 1 and key is None and value_start is None:
                key_start = i
        elif ch == ":" and depth == 1 and key is not None and value_start is None:
            value_start = i + 1
        elif ch in ",}" and depth == 1:
            if value_start is not None:
                fields[key] = json.loads(text[value_start:i])
            key, key_start, value_start = None, None, None
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return fields


class PartialFields:
    """The fields of one gen's object completed so far, and who waits for which (on the run's loop)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self._waiters: dict[str, asyncio.Future] = {}

    def update(self, text: str) -> None:
        """The gen's text so far: wakes the waiters of fields it completes."""
        for key, value in complete_fields(text).items():
            if key in self.fields:
                continue
            self.fields[key] = value
            waiter = self._waiters.pop(key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(value)

    async def wait(self, key: str, node: asyncio.Future) -> Any:
        """The field's value once complete, or MISSING if the node (its whole output) ends first."""
        if key in self.fields:
            return self.fields[key]
        waiter = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
        await asyncio.wait({waiter, node}, return_when=asyncio.FIRST_COMPLETED)
        return waiter.result() if waiter.done() else MISSING
