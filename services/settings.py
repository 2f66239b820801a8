"""Configuration: a frozen dataclass -> argparse flags with env fallback.

Every field `field_name` of a role's config dataclass becomes the flag
`--field-name` and the environment variable `MOEMESH_FIELD_NAME`. The flag
wins over the env var, the env var over the field's default; a field
without a default must come from one of the two. The type comes from the
annotation (str, int, float, bool, pathlib.Path, `X | None`, `tuple[X, ...]`
as a comma-separated list); the help from the field's `metadata["help"]` or
else from the `#` comment lines right above the field in the class body;
`metadata["aliases"]` adds other flags for the same field (`--host` is also
`--bind-host`).
The dataclass's `__post_init__` validates; its ValueError becomes a usage
error (exit status 2) naming the bad value.

`MemberConfig` holds the fields every registered process shares. What a
role's process does with its config at start-up (logging, signals, the port
file) is in services/process.py.
"""

import argparse
import dataclasses
import inspect
import os
import pathlib
import re
import types
import typing
from collections.abc import Mapping, Sequence

from services import gc_pauses, netaddr

ENV_PREFIX = "MOEMESH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_FIELD_LINE = re.compile(r"^\s*(\w+)\s*:")
_COMMENT_LINE = re.compile(r"^\s*#\s?(.*)$")

T = typing.TypeVar("T")


def env_var(field_name: str) -> str:
    """The environment variable of a config field: MOEMESH_FIELD_NAME."""
    return ENV_PREFIX + field_name.upper()


def flag(field_name: str) -> str:
    """The command-line flag of a config field: --field-name."""
    return "--" + field_name.replace("_", "-")


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Builds cls from argv (default sys.argv[1:]) and env (default os.environ)."""
    parser = build_parser(cls, env=env, prog=prog)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ValueError as error:
        parser.error(str(error))
        raise  # parser.error exits; this keeps type checkers honest


def build_parser(
    cls: type, *, env: Mapping[str, str] | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    """An ArgumentParser with one flag per field of the dataclass cls."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    parser = argparse.ArgumentParser(
        prog=prog,
        description=inspect.getdoc(cls),
    )
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        _add_argument(parser, field, hints[field.name], comments.get(field.name, ""), env)
    return parser


def _add_argument(parser, field: dataclasses.Field, hint, comment: str, env) -> None:
    convert = _converter(hint)
    help_text = field.metadata.get("help", comment) or None
    name = env_var(field.name)
    help_text = f"{help_text + ' ' if help_text else ''}[env {name}]"
    kwargs: dict = {"dest": field.name}
    if name in env:
        try:
            kwargs["default"] = convert(env[name])
        except (ValueError, TypeError) as error:
            parser.error(f"environment variable {name}={env[name]!r}: {error}")
    elif field.default is not dataclasses.MISSING:
        kwargs["default"] = field.default
    elif field.default_factory is not dataclasses.MISSING:
        kwargs["default"] = field.default_factory()
    else:
        kwargs["required"] = True
    shown = "required" if "required" in kwargs else f"default {kwargs['default']!r}"
    kwargs["help"] = f"{help_text} ({shown})".replace("%", "%%")  # argparse formats help with %
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = convert
        kwargs["metavar"] = field.name.upper()
    parser.add_argument(flag(field.name), *field.metadata.get("aliases", ()), **kwargs)


def _converter(hint) -> typing.Callable[[str], typing.Any]:
    """The str -> value conversion for a field annotation."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported config annotation {hint!r}")
        convert_inner = _converter(inner[0])
        return lambda text: None if text.strip().lower() in ("", "none") else convert_inner(text)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported config annotation {hint!r}: use tuple[X, ...]")
        convert_item = _converter(args[0])
        return lambda text: tuple(convert_item(p.strip()) for p in text.split(",") if p.strip())
    if hint is bool:
        return _parse_bool
    if hint in (str, int, float, pathlib.Path):
        return hint
    raise TypeError(f"unsupported config annotation {hint!r}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {text!r}")


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `#` comment lines right above it in the class body."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        pending: list[str] = []
        for line in lines:
            comment = _COMMENT_LINE.match(line)
            if comment:
                pending.append(comment.group(1).strip())
                continue
            field = _FIELD_LINE.match(line)
            if field and pending:
                comments[field.group(1)] = " ".join(pending)
            pending = []
    return comments


@dataclasses.dataclass(frozen=True, slots=True)
class MemberConfig:
    """Fields every process registered in etcd shares; roles subclass this
    and call `MemberConfig.__post_init__(self)` from their own check."""

    # Unique id of this process in the mesh (e.g. s0, r0, e3).
    member_id: str
    # etcd client endpoints, host:port, comma-separated for a cluster
    # (h1:2379,h2:2379,h3:2379): the client uses the first that answers and
    # moves to the next when it goes away.
    etcd: str = "127.0.0.1:2379"
    # Interface the gRPC server binds (also --bind-host). Empty: 127.0.0.1 when
    # etcd is on this host and nothing else is advertised, else 0.0.0.0 (every
    # interface), so that peers on other hosts reach it.
    host: str = dataclasses.field(default="", metadata={"aliases": ("--bind-host",)})
    # Host that peers use to reach this process (registered in etcd). Empty: the
    # bind host if it is a specific address; for a wildcard bind 127.0.0.1 when
    # etcd is on this host, else this host's address on the interface that
    # routes to etcd (services/netaddr.py), never a loopback address. In
    # Kubernetes: the pod IP.
    advertise_host: str = ""
    # How long to wait for etcd at start before exiting with an error naming
    # the endpoints: a wrong --etcd fails fast instead of hanging.
    etcd_connect_timeout_s: float = 10.0
    # gRPC port; 0 picks a free one (see port_file).
    port: int = 0
    # If set, the bound port is written to this file once the server listens,
    # so a launcher can find servers started with port 0.
    port_file: str = ""
    # TTL of this process's etcd lease: how long a crash goes unnoticed at most.
    # etcd's minimum is 1 s with our raft flags.
    lease_ttl_s: int = 2
    # Root of every key this mesh writes in etcd.
    key_prefix: str = "/moemesh"
    # Python logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    # Log line format: text (for people) or json (one object per line, with
    # the request and trace ids; for log pipelines).
    log_format: str = "text"
    # Port of the HTTP server for /metrics, /healthz and /readyz; 0 picks a
    # free one (written to port_file + ".metrics").
    metrics_port: int = 9090
    # Interface the HTTP metrics and probe server binds; empty means host.
    metrics_host: str = ""
    # Once the process is ready, freeze the objects alive then (gc.freeze), so
    # the garbage collector's full collections skip them (services/gc_pauses.py).
    gc_freeze: bool = True
    # Net allocations of container objects that trigger a young-generation
    # collection, set with the freeze (gc.set_threshold's first value); 0 keeps
    # Python's (700). Larger: fewer collections (and fewer full ones), each of
    # more objects, most of which reference counting has freed by then.
    gc_young_threshold: int = gc_pauses.DEFAULT_YOUNG_THRESHOLD
    # Directory with ca.crt, tls.crt and tls.key (a Kubernetes TLS Secret): turns
    # on mutual TLS for every gRPC server and channel of the process and for
    # etcd (services/tls.py, docs/security.md); empty: plaintext. Its files are
    # read at start-up (a missing one stops the process), not when parsing.
    tls_dir: str = ""

    def __post_init__(self) -> None:
        if not self.member_id or "/" in self.member_id or self.member_id.strip() != self.member_id:
            raise ValueError(f"member_id must be non-empty, without '/' or spaces, got {self.member_id!r}")
        try:
            etcd_hosts = [host for host, _ in netaddr.split_endpoints(self.etcd)]
        except ValueError:
            raise ValueError(f"etcd must be host:port[,host:port...], got {self.etcd!r}") from None
        if self.etcd_connect_timeout_s <= 0:
            raise ValueError(f"etcd_connect_timeout_s must be > 0, got {self.etcd_connect_timeout_s}")
        self._resolve_hosts(etcd_hosts)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be >= 1 (etcd's minimum), got {self.lease_ttl_s}")
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise ValueError(f"key_prefix must start and not end with '/', got {self.key_prefix!r}")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.gc_young_threshold < 0:
            raise ValueError(f"gc_young_threshold must be >= 0, got {self.gc_young_threshold}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")

    def _resolve_hosts(self, etcd_hosts: list[str]) -> None:
        """Fills an empty host and advertise_host with their defaults (see the
        fields), once, so that every later read agrees; ValueError for a
        loopback address when etcd is on another host."""
        remote = [h for h in etcd_hosts if not netaddr.is_loopback(h)]
        advertised = self.advertise_host
        if not self.host:
            is_local = not remote and (not advertised or netaddr.is_loopback(advertised))
            object.__setattr__(self, "host", "127.0.0.1" if is_local else "0.0.0.0")
        if remote and netaddr.is_loopback(self.host):
            raise ValueError(f"host (--bind-host) {self.host!r} is a loopback address but etcd at {remote[0]!r} "
                             f"is on another host: peers could not reach this process; bind 0.0.0.0 or an "
                             f"address of this host")
        if not advertised:
            object.__setattr__(self, "advertise_host", netaddr.default_advertise_host(self.host, etcd_hosts))
        elif remote and netaddr.is_loopback(advertised):
            raise ValueError(f"advertise_host {advertised!r} is a loopback address but etcd at {remote[0]!r} is "
                             f"on another host: peers there could not reach it")

    @property
    def public_host(self) -> str:
        """The host other processes reach this one at (advertise_host, filled at construction)."""
        host = self.advertise_host
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    def address(self, port: int) -> str:
        """The address registered in etcd for a server bound to port."""
        return f"{self.public_host}:{port}"
