"""The manifests and `moemesh up` share config fields and defaults: the base
ConfigMaps carry the dataclass defaults, docs/deploy.md documents every knob
the manifests set with the dataclass default, and the manifests set every
field the launcher sets explicitly."""

import dataclasses
import inspect
import re

import pytest

from moemesh import launcher
from services import settings
from tests.deploy.kube import ROLES, ROOT, role_config, role_container

DOCS = ROOT / "docs" / "deploy.md"
# Fields the deployment sets to something else than `moemesh up`'s default, and why.
DEPLOYMENT_FIELDS = {
    "member_id": "the pod name",
    "advertise_host": "the pod IP: what other pods reach",
    "host": "0.0.0.0: reachable from other pods",
    "etcd": "the etcd client Service",
    "port": "fixed per role: the container port, the probes and the Services name it",
    "rendezvous_port": "fixed, a declared container port",
    "model": "a path on the models volume",
    "group_size": "the expert replicas",
    "tls_dir": "the mounted TLS Secret: mutual TLS where the mesh is deployed (docs/security.md)",
    "api_keys": "the mounted API-key Secret: clients authenticate where the mesh is deployed (docs/security.md)",
}
_ROW = re.compile(r"^\| `(MOEMESH_[A-Z0-9_]+)` \| `(--[a-z0-9-]+)` \| ([^|]+) \|")


def role_fields() -> dict[str, dataclasses.Field]:
    """Field name -> field, over every role (shared fields have one default)."""
    fields: dict[str, dataclasses.Field] = {}
    for role in ROLES.values():
        for field in dataclasses.fields(role.config_cls):
            assert field.name not in fields or fields[field.name].default == field.default, field.name
            fields[field.name] = field
    return fields


def role_env(docs: list[dict], role: str) -> dict[str, str]:
    return role_container(docs, role)[2]


def documented_knobs() -> dict[str, tuple[str, str]]:
    """MOEMESH_* -> (flag, default cell) from the tables in docs/deploy.md."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3).strip())
    return rows


def test_deployment_fields_are_config_fields():
    assert set(DEPLOYMENT_FIELDS) <= set(role_fields())


@pytest.mark.parametrize("role", sorted(ROLES))
def test_base_configmaps_carry_the_launcher_defaults(rendered, role):
    env = role_env(rendered["base"], role)
    config = role_config(rendered["base"], role)
    for field in dataclasses.fields(config):
        if settings.env_var(field.name) in env and field.name not in DEPLOYMENT_FIELDS:
            assert getattr(config, field.name) == field.default, (
                f"base sets {settings.env_var(field.name)}={env[settings.env_var(field.name)]!r}, "
                f"the default of {role}'s {field.name} is {field.default!r}")


def test_documented_defaults_are_the_dataclass_defaults():
    fields = role_fields()
    rows = documented_knobs()
    assert len(rows) >= 20
    for var, (flag, default) in rows.items():
        name = var.removeprefix(settings.ENV_PREFIX).lower()
        assert name in fields, f"docs/deploy.md documents {var}, which no role has"
        assert flag == settings.flag(name)
        field = fields[name]
        if field.default is dataclasses.MISSING:
            assert default == "required", var
            continue
        text = default.strip("`")
        value = "" if text == '""' else type(field.default)(text)
        assert value == field.default, f"docs/deploy.md says {var} defaults to {default}, the code {field.default!r}"


def test_every_knob_the_manifests_set_is_documented(rendered):
    documented = documented_knobs()
    text = DOCS.read_text()
    for name, docs in rendered.items():
        for role in ROLES:
            for var in role_env(docs, role):
                if var.startswith(settings.ENV_PREFIX):
                    assert var in documented, f"{name}: {role} gets {var}, not in docs/deploy.md's tables"
                else:
                    assert var in text, f"{name}: {role} gets {var}, not mentioned in docs/deploy.md"


def launcher_flags() -> set[str]:
    """The flags `moemesh up` passes to the roles it starts."""
    return set(re.findall(r'"(--[a-z][a-z-]*)"', inspect.getsource(launcher.Mesh)))


@pytest.mark.parametrize("role", sorted(ROLES))
def test_manifests_set_every_field_the_launcher_sets(rendered, role):
    flags = launcher_flags()
    assert {"--member-id", "--etcd", "--model", "--group-size", "--port"} <= flags
    fields = {f.name for f in dataclasses.fields(ROLES[role].config_cls)}
    for flag in flags - {"--port-file"}:  # only for port 0, which the manifests never use
        name = flag.removeprefix("--").replace("-", "_")
        if name in fields:
            for overlay, docs in rendered.items():
                assert settings.env_var(name) in role_env(docs, role), f"{overlay}: {role} lacks {flag}"
