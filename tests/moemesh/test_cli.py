"""`moemesh generate`'s request (through the client's arguments): the constraint flags, mutually exclusive, into
SamplingParams' oneof."""

import json

import pytest

from moemesh import cli, client_request


def request(*argv):
    args = cli.build_parser().parse_args(["generate", "a prompt", *argv])
    return client_request.generate_request(**cli.generate_arguments(args))


def test_json_schema_is_read_from_its_file(tmp_path):
    schema = tmp_path / "ticket.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    req = request("--json-schema", str(schema), "--seed", "3")
    assert req.sampling.WhichOneof("constraint") == "json_schema"
    assert req.sampling.json_schema == schema.read_text() and req.sampling.seed == 3
    with pytest.raises(ValueError, match="--json-schema: cannot read .*missing.json"):
        request("--json-schema", str(tmp_path / "missing.json"))


def test_regex_and_choice():
    assert request("--regex", "[0-9]{3}").sampling.regex == "[0-9]{3}"
    req = request("--choice", "yes,no,not sure")
    assert req.sampling.WhichOneof("constraint") == "choice"
    assert list(req.sampling.choice.options) == ["yes", "no", "not sure"]
    assert request().sampling.WhichOneof("constraint") is None


def test_constraint_flags_are_mutually_exclusive(capsys):
    with pytest.raises(SystemExit):
        request("--regex", "a", "--choice", "a,b")
    assert "not allowed with argument" in capsys.readouterr().err
