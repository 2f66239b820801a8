"""`moemesh generate`'s request (through the client's arguments): the constraint flags, mutually exclusive, into
SamplingParams' oneof; the priority flag, `moemesh up --api-keys`, and where the client's API key comes from."""

import json

import pytest

from moe.gateway.v1 import gateway_pb2
from moemesh import cli, client_request
from moemesh.client import auth_metadata


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


def test_priority_flag_and_up_api_keys():
    assert request().priority == gateway_pb2.PRIORITY_INTERACTIVE
    assert request("--priority", "batch").priority == gateway_pb2.PRIORITY_BATCH
    assert cli.build_parser().parse_args(["up", "--api-keys", "keys.json"]).api_keys == "keys.json"
    with pytest.raises(ValueError, match="priority must be one of"):
        client_request.generate_request("a", priority="urgent")


def test_the_api_key_comes_from_the_argument_else_the_environment(monkeypatch):
    monkeypatch.setenv("MOEMESH_API_KEY", "from-env")
    assert auth_metadata(None) == (("authorization", "Bearer from-env"),)
    assert auth_metadata("given") == (("authorization", "Bearer given"),)
    monkeypatch.delenv("MOEMESH_API_KEY")
    assert auth_metadata(None) == ()
