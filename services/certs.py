"""Issuing the mesh's certificates: a throwaway CA and one certificate per
role, for `moemesh up --tls` and the tests (production issues them with
cert-manager or its own PKI; docs/security.md).

Each member certificate carries the role as subject CN (etcd's user name
under --client-cert-auth) and the DNS SAN `<role>.moemesh` that services.tls
checks, plus any extra DNS names and IPs (127.0.0.1 and localhost for a local
mesh, so grpcurl works against the addresses too). Keys are ECDSA P-256:
fast to make and to handshake with. A member directory holds ca.crt, tls.crt
and tls.key (services.tls), written atomically (a temporary file renamed over
the old one), so a process that reloads never reads a half-written file.
"""

import dataclasses
import datetime
import ipaddress
import os
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services import tls

# The etcd user that enables authentication and creates the members' users (CN only).
ETCD_ROOT = "root"
LOCAL_DNS = ("localhost",)
LOCAL_IPS = ("127.0.0.1",)


@dataclasses.dataclass(frozen=True, slots=True)
class Pem:
    """A certificate and its key, PEM-encoded."""

    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "moemesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "moemesh CA", days: int = 365) -> Pem:
    """A self-signed CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(ca: Pem, common_name: str, dns_names=(), ips=(), days: int = 365) -> Pem:
    """A certificate signed by ca for both TLS server and client use."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_role(ca: Pem, role: str, dns_names=LOCAL_DNS, ips=LOCAL_IPS, days: int = 365) -> Pem:
    """A member certificate of role: CN role, SANs `<role>.moemesh` plus dns_names and ips."""
    return issue(ca, role, (tls.san(role), *dns_names), ips, days)


def _write(path: pathlib.Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_member(directory: str | os.PathLike, ca_cert: bytes, pem: Pem) -> tls.TlsFiles:
    """Writes ca.crt, tls.crt and tls.key (key last: a reloader checks that the pair matches)."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _write(path / tls.CA_FILE, ca_cert)
    _write(path / tls.CERT_FILE, pem.cert)
    _write(path / tls.KEY_FILE, pem.key, 0o600)
    return tls.TlsFiles.from_dir(path)


def make_local_pki(root: str | os.PathLike) -> dict[str, pathlib.Path]:
    """A CA under root (ca.crt, ca.key) and a member directory per role, for
    etcd's server (`etcd`) and for etcd's root user (`root`); name -> directory."""
    path = pathlib.Path(root)
    path.mkdir(parents=True, exist_ok=True)
    ca = make_ca()
    _write(path / "ca.crt", ca.cert)
    _write(path / "ca.key", ca.key, 0o600)
    dirs = {role: path / role for role in tls.ROLES}
    for role, directory in dirs.items():
        write_member(directory, ca.cert, issue_role(ca, role))
    dirs["etcd"] = path / "etcd"
    write_member(dirs["etcd"], ca.cert, issue(ca, "etcd", (tls.ETCD_SAN, *LOCAL_DNS), LOCAL_IPS))
    dirs[ETCD_ROOT] = path / ETCD_ROOT
    write_member(dirs[ETCD_ROOT], ca.cert, issue(ca, ETCD_ROOT))
    return dirs
