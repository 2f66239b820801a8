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


def test_up_tls_flag_and_the_operator_certificates(tmp_path):
    """`up --tls` asks for a TLS mesh; `generate`/`status` use --tls-dir, else the
    operator's files of the mesh `up --tls` started, for its own addresses only."""
    from services import certs, tls

    assert cli.build_parser().parse_args(["up", "--tls"]).tls is True
    assert cli.build_parser().parse_args(["up"]).tls is False
    ca = certs.make_ca()
    certs.write_member(tmp_path / "operator", ca.cert, certs.issue_role(ca, "operator"))
    state = {"gateway": "127.0.0.1:5001", "schedulers": ["127.0.0.1:5002"], "tls_dir": str(tmp_path / "operator")}

    def channel_args(*argv, role="gateway", state=state):
        command = "status" if role == "scheduler" else "generate"
        args = cli.build_parser().parse_args([command, *(["x"] if command == "generate" else []), *argv])
        return cli.tls_channel_args(args, role, state)

    credentials, options = channel_args()
    assert credentials is not None and options == tls.channel_options("gateway")
    assert channel_args("--target", "127.0.0.1:5002", role="scheduler")[1] == tls.channel_options("scheduler")
    assert channel_args("--target", "10.0.0.9:50051") == (None, ())  # another mesh: plaintext unless told
    assert channel_args("--target", "10.0.0.9:50051", "--tls-dir", str(tmp_path / "operator"))[0] is not None
    assert channel_args(state={}) == (None, ())  # a plaintext local mesh
    with pytest.raises(ValueError, match="has no ca.crt"):
        channel_args("--tls-dir", str(tmp_path))
