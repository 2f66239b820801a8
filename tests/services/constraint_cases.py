"""Constraints for the tests of services/constraints.py and its torch mask, with hand-written validators.

The validators check what each constraint promises (JSON Schema semantics written out by hand,
so that a bug in the engine cannot hide behind a shared library), and `check_json_form` the
bounded whitespace form of JSON output.
"""

import functools
import json
import re
from pathlib import Path

import services.model
from services.constraints import Compiler
from services.step import Constraint
from services.tokenizer import Tokenizer

QWEN3_MODEL_VOCAB = 151_936   # Qwen3-MoE's logits width (the tokenizer has 151,669 tokens)

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "is_dispute": {"type": "boolean"},
        "amount": {"type": "number"},
        "date_range": {"type": "array", "items": {"type": "string", "pattern": rf"^{DATE}$"},
                       "minItems": 2, "maxItems": 2},
        "order_id": {"type": "string", "pattern": r"^ORD-[0-9]{6}$"},
    },
    "required": ["is_dispute", "amount", "date_range", "order_id"],
    "additionalProperties": False,
}
NESTED_SCHEMA = {
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                "tags": {"type": "array", "items": {"enum": ["fragile", "gift", "bulk"]}, "maxItems": 3},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "priority": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"const": "urgent"}]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "ship_to": {"$ref": "#/$defs/address"},
        "note": {"type": ["string", "null"], "maxLength": 30},
    },
    "required": ["status", "priority", "items", "ship_to"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{3}-[0-9]{2,4}( [a-z]{1,8}){1,3}\."
GRAMMAR = """
start: "SELECT " column (", " column)* " FROM " name where?
where: " WHERE " column " = " /[0-9]{1,4}/
column: name
name: /[a-z_]{1,8}/
"""
GRAMMAR_REGEX = r"SELECT [a-z_]{1,8}(, [a-z_]{1,8})* FROM [a-z_]{1,8}( WHERE [a-z_]{1,8} = [0-9]{1,4})?"
CHOICES = ("refund", "replacement", "escalate to a human", "no action", 'say "hi" \\ (ok?) ñ')

TICKET = Constraint("json_schema", json.dumps(TICKET_SCHEMA))
CONSTRAINTS = {
    "ticket": TICKET,
    "nested": Constraint("json_schema", json.dumps(NESTED_SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", REGEX),
    "grammar": Constraint("grammar", GRAMMAR),
    "choice": Constraint("choice", CHOICES),
}


@functools.cache
def qwen3() -> Tokenizer:
    """The real Qwen3 tokenizer (services.tokenizer), built once per test session."""
    return Tokenizer.qwen3()


@functools.cache
def demo_tokenizer() -> Tokenizer:
    """The bundled demo model's own tokenizer (8,192 tokens)."""
    return Tokenizer.from_model_dir(Path(services.model.__file__).parent / "demo")


@functools.cache
def qwen3_compiler() -> Compiler:
    """One Compiler for the Qwen3 tokenizer and the model's logits width, shared by the tests."""
    return Compiler.for_tokenizer(qwen3(), QWEN3_MODEL_VOCAB)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ticket(value) -> None:
    assert isinstance(value, dict) and list(value) == ["is_dispute", "amount", "date_range", "order_id"], value
    assert isinstance(value["is_dispute"], bool)
    assert _is_number(value["amount"])
    dates = value["date_range"]
    assert isinstance(dates, list) and len(dates) == 2
    assert all(isinstance(d, str) and re.fullmatch(DATE, d) for d in dates), dates
    assert isinstance(value["order_id"], str) and re.fullmatch(r"ORD-[0-9]{6}", value["order_id"])


def check_nested(value) -> None:
    assert isinstance(value, dict) and {"status", "priority", "items", "ship_to"} <= set(value), value
    assert set(value) <= {"status", "priority", "items", "ship_to", "note"}, value
    assert value["status"] in ("open", "closed", "pending")
    priority = value["priority"]
    assert priority == "urgent" or (type(priority) is int and 1 <= priority <= 5), priority
    assert isinstance(value["items"], list) and 1 <= len(value["items"]) <= 3
    for item in value["items"]:
        assert isinstance(item, dict) and {"sku", "qty"} <= set(item) <= {"sku", "qty", "tags"}, item
        assert isinstance(item["sku"], str) and re.fullmatch("[A-Z]{2}-[0-9]{3}", item["sku"])
        assert type(item["qty"]) is int and 1 <= item["qty"] <= 99
        tags = item.get("tags", [])
        assert isinstance(tags, list) and len(tags) <= 3 and all(t in ("fragile", "gift", "bulk") for t in tags)
    ship_to = value["ship_to"]
    assert isinstance(ship_to, dict) and set(ship_to) == {"city", "zip"}
    assert isinstance(ship_to["city"], str) and 1 <= len(ship_to["city"]) <= 20
    assert isinstance(ship_to["zip"], str) and re.fullmatch("[0-9]{5}", ship_to["zip"])
    note = value.get("note")
    assert note is None or (isinstance(note, str) and len(note) <= 30)


def check_json_form(text: str) -> None:
    """Outside string literals, the only whitespace is one space after each ',' and ':'."""
    is_in_string = is_escaped = False
    for i, char in enumerate(text):
        if is_in_string:
            is_escaped, is_in_string = (False, True) if is_escaped else (char == "\\", char != '"')
        elif char == '"':
            is_in_string = True
        elif char.isspace():
            assert char == " " and text[i - 1] in ",:" and not text[i + 1].isspace(), (i, text)


def check_output(name: str, text: str) -> None:
    """`text` (the output without its EOS) satisfies CONSTRAINTS[name]."""
    if name in ("ticket", "nested", "json_object"):
        value = json.loads(text)
        check_json_form(text)
        {"ticket": check_ticket, "nested": check_nested, "json_object": lambda v: isinstance(v, dict)}[name](value)
        assert isinstance(value, dict)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "grammar":
        assert re.fullmatch(GRAMMAR_REGEX, text), text
    else:
        assert text in CHOICES, text
