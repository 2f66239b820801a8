"""Mutual TLS between the mesh's roles: credentials from files, reloaded on
change, and the table of which role may call which RPC.

Files: a directory (`--tls-dir`, `MOEMESH_TLS_DIR`) holding `ca.crt` (the CA
bundle that signs every member), `tls.crt` and `tls.key` (this process's
certificate chain and key): the layout of a Kubernetes TLS Secret that
cert-manager writes, so the Secret mounts as is.

Identity: a member's certificate names its role in a DNS SAN `<role>.moemesh`
(ROLES) and carries the role as its subject CN, the user name etcd maps a
client certificate to. Every channel between roles sets the TLS target name
to the SAN of the role it calls (`grpc.ssl_target_name_override`), so the
caller checks the server's role in the handshake, whatever address (a pod IP)
the server registered; the server checks the caller's role per RPC
(`RoleInterceptor`, ACCESS). A certificate of another CA fails the handshake
both ways.

Rotation: the server credentials are dynamic; gRPC asks for them at every
handshake and gets new ones when one of the three files changed (its mtime,
size or inode: a Kubernetes Secret update swaps a symlink), once the new
certificate and key match. Channels read the files when they are created:
established connections and their streams keep the TLS session they have, a
new connection uses the new files.

`configure()` sets the process's TLS once at start-up (services.process); the
gRPC helpers (services.grpc_util) and the etcd client (services.cluster) use
`active()`. None (the default) keeps everything plaintext, as on loopback.
"""

import dataclasses
import inspect
import logging
import os
import pathlib

import grpc

log = logging.getLogger(__name__)

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
SAN_SUFFIX = ".moemesh"
# The etcd server's certificate names this; the members' etcd channels check it.
ETCD_SAN = "etcd" + SAN_SUFFIX
# Every role with a certificate; "operator" is the operator's tools (`moemesh status`, grpcurl).
ROLES = ("gateway", "expert", "router", "scheduler", "operator")
# Any caller, with a certificate or without: the gateway's public API (clients
# authenticate there with API keys) and the standard services. A server other
# than the gateway requires a certificate of the CA in the handshake already.
PUBLIC_SERVICES = frozenset({"moe.gateway.v1.GenerationService", "grpc.health.v1.Health",
                             "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"})
# Which roles may call each RPC of the role services, from who calls what in the
# code: the gateway drives the ranks' step streams; a rank reports hits to the
# router; the router proposes placements to the scheduler leader; the operator
# reads state. An RPC missing here is refused (tests check every RPC is listed).
ACCESS = {
    "/moe.expert.v1.ExpertService/ExecuteSteps": frozenset({"gateway"}),
    "/moe.expert.v1.ExpertService/GetRankInfo": frozenset({"gateway", "operator"}),
    "/moe.router.v1.RouterService/ReportExpertHits": frozenset({"expert"}),
    "/moe.router.v1.RouterService/GetExpertStats": frozenset({"operator"}),
    "/moe.scheduler.v1.SchedulerService/ProposePlacement": frozenset({"router"}),
    "/moe.scheduler.v1.SchedulerService/GetClusterState": frozenset({"operator", "scheduler"}),
}


def san(role: str) -> str:
    """The DNS SAN (and TLS target name) of a role: `<role>.moemesh`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role + SAN_SUFFIX


@dataclasses.dataclass(frozen=True, slots=True)
class TlsFiles:
    """The CA bundle, certificate chain and key of one member."""

    ca: pathlib.Path
    cert: pathlib.Path
    key: pathlib.Path

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "TlsFiles":
        """ca.crt, tls.crt and tls.key in directory; ValueError naming a missing one."""
        path = pathlib.Path(directory)
        files = cls(path / CA_FILE, path / CERT_FILE, path / KEY_FILE)
        for file in (files.ca, files.cert, files.key):
            if not file.is_file():
                raise ValueError(f"TLS directory {str(path)!r} has no {file.name}")
        return files

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) as PEM bytes."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()

    def stamp(self) -> tuple:
        """Changes whenever one of the files is replaced or rewritten."""
        stats = [os.stat(f) for f in (self.ca, self.cert, self.key)]
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)


@dataclasses.dataclass(frozen=True, slots=True)
class MeshTls:
    """This process's TLS: its files and its role."""

    files: TlsFiles
    role: str

    def __post_init__(self) -> None:
        san(self.role)


_active: MeshTls | None = None


def configure(tls: MeshTls | None) -> None:
    """Sets the process's TLS (None: plaintext); called once at start-up."""
    global _active
    _active = tls
    if tls is not None:
        log.info("mutual TLS on as %s (certificate %s)", tls.role, tls.files.cert)


def active() -> MeshTls | None:
    """The process's TLS, or None when the mesh runs plaintext."""
    return _active


def _key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """Whether the key is the first certificate's: a rotation caught between
    writing the two files must not hand gRPC a pair that cannot handshake."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    return cert.public_key().public_bytes(serialization.Encoding.PEM, raw) == \
        key.public_key().public_bytes(serialization.Encoding.PEM, raw)


def _server_config(files: TlsFiles):
    ca, cert, key = files.read()
    if not _key_matches(cert, key):
        raise ValueError(f"{files.key} is not the key of {files.cert}")
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def server_credentials(files: TlsFiles, *, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """Server credentials that follow the files: each handshake asks the fetcher,
    which returns a new configuration only when the files changed and are a
    consistent pair (else None: gRPC keeps the one it has)."""
    seen = {"stamp": files.stamp()}
    initial = _server_config(files)

    def fetch():
        try:
            stamp = files.stamp()
            if stamp == seen["stamp"]:
                return None
            config = _server_config(files)
        except (OSError, ValueError) as error:
            log.warning("keeping the current TLS certificate: %s", error)
            return None
        seen["stamp"] = stamp
        log.info("reloaded the TLS certificate from %s", files.cert)
        return config

    return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                               require_client_authentication=require_client_cert)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Channel credentials from the files as they are now (a new channel reads them again)."""
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel_options(peer_role: str) -> list[tuple[str, str]]:
    """The channel option that makes the handshake check the server's role."""
    return [("grpc.ssl_target_name_override", san(peer_role))]


def peer_roles(context) -> frozenset[str]:
    """The roles the caller's verified certificate names (empty without one)."""
    sans = context.auth_context().get("x509_subject_alternative_name", [])
    names = (name.decode() if isinstance(name, bytes) else name for name in sans)
    return frozenset(n[:-len(SAN_SUFFIX)] for n in names
                     if n.endswith(SAN_SUFFIX) and n[:-len(SAN_SUFFIX)] in ROLES)


async def _check(method: str, allowed: frozenset[str], context) -> None:
    roles = peer_roles(context)
    if not roles:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a mesh certificate")
    if not roles & allowed:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{method} is not allowed for role {', '.join(sorted(roles))}")


def _guarded(method: str, allowed: frozenset[str], behavior):
    """behavior, called only once the caller's role is allowed."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            await _check(method, allowed, context)
            async for item in behavior(request, context):
                yield item
        return stream

    async def call(request, context):
        await _check(method, allowed, context)
        return await behavior(request, context)
    return call


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call whose caller's certificate does not name a role ACCESS
    allows for the method (UNAUTHENTICATED without a certificate,
    PERMISSION_DENIED for another role, PERMISSION_DENIED for an unlisted RPC)."""

    def __init__(self, access=None, public_services=PUBLIC_SERVICES):
        self._access = ACCESS if access is None else access
        self._public = frozenset(public_services)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method[1:].partition("/")[0] in self._public:
            return handler
        allowed = self._access.get(method, frozenset())
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                    if getattr(handler, k) is not None)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(_guarded(method, allowed, getattr(handler, kind)),
                    handler.request_deserializer, handler.response_serializer)
