"""The program language's checks, without a mesh: bad steps fail where they are written; a JSON
gen's fields as they stream."""

import json

import pytest

import moemesh
from moemesh.program.partial import complete_fields
from moemesh.program.state import State


def test_steps_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="at most one of regex, json_schema, choices"):
        moemesh.gen("x", regex="a", choices=["a"])
    with pytest.raises(ValueError, match="choices must differ"):
        moemesh.select("x", ["a", "a"])
    with pytest.raises(ValueError, match="non-empty texts"):
        moemesh.select("x", "ab")
    with pytest.raises(ValueError, match="normalize"):
        moemesh.select("x", ["a", "b"], normalize="max")
    assert moemesh.gen("x", 8, choices=["a", "b"], seed=3).sampling() == {
        "max_new_tokens": 8, "stop": (), "temperature": 0.0, "choice": ["a", "b"], "seed": 3}


def test_a_state_takes_only_steps_and_names_missing_variables():
    state = State(run=None)
    with pytest.raises(TypeError, match="cannot add int"):
        state += 3
    with pytest.raises(KeyError, match="no variable 'answer'"):
        state["answer"]
    with pytest.raises(ValueError, match="n >= 1"):
        state.fork(0)


def test_bind_names_the_node_after_the_tool():
    def lookup(order_id):
        return order_id
    step = moemesh.bind(lookup, order_id=3)
    assert (step.name, dict(step.args)) == ("lookup", {"order_id": 3})


def test_complete_fields_gives_each_top_level_value_once_it_is_complete():
    text = '{"order_id": 48213, "note": "a, {b}\\" c", "nested": {"x": [1, {"y": 2}]}, "urgent": true}'
    complete = {"order_id": text.index(", "), "note": text.index(', "nested"'), "nested": text.index(', "urgent"'),
                "urgent": len(text) - 1}
    final = json.loads(text)
    for end in range(len(text) + 1):
        fields = complete_fields(text[:end])
        assert fields == {key: final[key] for key, at in complete.items() if end > at}, text[:end]
    assert complete_fields("[1, 2]") == {} and complete_fields("") == {}
