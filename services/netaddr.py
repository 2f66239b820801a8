"""Which address of this host to advertise to the mesh, and checks on addresses.

A process registers in etcd the address its peers dial (`--advertise-host`).
On one machine that is loopback; across machines it must be an address of an
interface that the peers can route to. The default here is the source address
the kernel picks for a packet towards the etcd host (`route_source_address`:
a UDP socket `connect`ed there sends nothing, it only asks the routing table):
the interface that reaches etcd is the one the mesh's network runs on, which
beats "the interface of the default route" on hosts whose default route goes
elsewhere (a management network, a NAT gateway). `interface_address` reads an
interface's IPv4 address (`--ep-interface`), `interface_of` finds the
interface that holds an address (so that gloo and NCCL use the same one).

Pure socket calls, no third-party imports; Linux for the interface ioctls.
"""

import fcntl
import ipaddress
import socket
import struct

# ioctl SIOCGIFADDR (linux/sockios.h): the IPv4 address of an interface by name.
_SIOCGIFADDR = 0x8915
WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def strip_brackets(host: str) -> str:
    """An IPv6 literal without the brackets of host:port notation."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of "host:port" or "[v6]:port"; ValueError naming the bad value."""
    host, _, port = endpoint.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {endpoint!r}")
    return strip_brackets(host), int(port)


def split_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """[(host, port)] of a comma-separated list of host:port (an etcd cluster's members)."""
    parts = [p for p in endpoints.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"expected host:port[,host:port...], got {endpoints!r}")
    return [split_endpoint(p) for p in parts]


def is_loopback(host: str) -> bool:
    """True for localhost and the addresses of 127/8 and ::1. A name other than
    localhost counts as remote: it is not resolved (no DNS at parse time)."""
    host = strip_brackets(host)
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True for the hosts that bind every interface."""
    return host in WILDCARDS


def route_source_address(host: str, port: int = 9) -> str:
    """The local address the kernel routes from towards host (resolved if a
    name); OSError (e.g. ENETUNREACH, or a name that does not resolve) if none."""
    infos = socket.getaddrinfo(strip_brackets(host), port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        return sock.getsockname()[0]


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface; ValueError naming it if it has
    none or does not exist."""
    if not interface or len(interface.encode()) > 15:
        raise ValueError(f"not an interface name: {interface!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()))
        except OSError as error:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ValueError(f"interface {interface!r} has no IPv4 address ({error.strerror}); "
                             f"interfaces here: {names}") from None
    return socket.inet_ntoa(answer[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface whose IPv4 address is `address` (None if none:
    an IPv6 or foreign address, or one that only a route covers, like 127.0.0.2)."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except ValueError:
            continue
    return None


def default_advertise_host(bind_host: str, etcd_hosts: list[str]) -> str:
    """The host a process registers when --advertise-host is not given.

    A specific bind host is its own answer. A wildcard bind: loopback when
    etcd is on this host (127.0.0.1), else the route source address towards
    the first etcd host. ValueError when etcd is remote but the only answer is
    a loopback address (peers on other hosts would dial themselves)."""
    remote = [h for h in etcd_hosts if not is_loopback(h)]
    if not is_wildcard(bind_host):
        host = strip_brackets(bind_host)
    elif not remote:
        return "127.0.0.1"
    else:
        try:
            host = route_source_address(remote[0])
        except OSError as error:
            raise ValueError(f"cannot find this host's address towards etcd host {remote[0]!r} ({error}); "
                             f"pass --advertise-host (an address of this host that the mesh can reach)") from None
    if remote and is_loopback(host):
        raise ValueError(f"etcd at {remote[0]!r} is on another host but this process would advertise "
                         f"the loopback address {host!r}, which peers cannot reach; pass --bind-host 0.0.0.0 "
                         f"or this host's address, or --advertise-host")
    return host
