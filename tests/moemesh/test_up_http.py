"""`moemesh up --http-port`: parsed, checked by MeshSpec, and where the gateway's HTTP port is found."""

import pytest

from moemesh import cli, launcher
from services import process


def test_up_serves_http_on_8000_by_default_and_takes_any_port_or_off():
    parser = cli.build_parser()
    assert parser.parse_args(["up"]).http_port == cli.DEFAULT_HTTP_PORT == 8000
    assert parser.parse_args(["up", "--http-port", "0"]).http_port == 0
    assert parser.parse_args(["up", "--http-port", "-1"]).http_port == -1


@pytest.mark.parametrize("port", [-2, 65536])
def test_a_bad_http_port_is_refused_naming_the_flag(tiny_model_dir, port):
    with pytest.raises(ValueError, match=f"--http-port must be in -1..65535 .*got {port}"):
        launcher.MeshSpec(model_dir=str(tiny_model_dir), http_port=port)


def test_the_gateways_http_port_is_read_from_its_port_file(tmp_path):
    role = launcher.Role(name="gateway", proc=None, port_file=tmp_path / "gateway.port", log_path=tmp_path / "log")
    assert role.http_port is None
    process.write_port_file(process.http_port_file(role.port_file), 8123)
    assert role.http_port == 8123 and process.http_port_file("x.port") == "x.port.http"
