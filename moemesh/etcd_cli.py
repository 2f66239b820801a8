"""`moemesh etcd`: one member of an etcd cluster across hosts, in the foreground.

    moemesh etcd --name n1 --listen-host 10.0.0.1 --data-dir /var/lib/moemesh-etcd \\
        --initial-cluster n1=http://10.0.0.1:2380,n2=http://10.0.0.2:2380,n3=http://10.0.0.3:2380

on each of three hosts (each with its own --name and --listen-host) makes a
3-member cluster that keeps serving with one host lost; the roles then take
`--etcd 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379`. It runs the bundled etcd
(moemesh/etcd.py) until Ctrl-C or SIGTERM, and says once the cluster has a
leader (a majority of the members runs). Plaintext: a cluster over an
untrusted network needs etcd's own TLS flags (docs/security.md).
"""

import argparse
import signal
import sys
import threading

from moemesh import etcd


def add_parser(sub) -> None:
    """Adds the `etcd` subcommand to the subparsers of `moemesh`."""
    parser = sub.add_parser("etcd", help="run one member of a 3-member etcd cluster across hosts")
    parser.add_argument("--name", required=True, help="this member's name in --initial-cluster")
    parser.add_argument("--initial-cluster", required=True, metavar="N1=http://H1:2380,...",
                        help="every member's name and peer URL, the same on every member")
    parser.add_argument("--listen-host", required=True,
                        help="this host's address, where clients (port --client-port) and peers reach it")
    parser.add_argument("--advertise-host", default="",
                        help="the address others reach this member at, when it listens on 0.0.0.0")
    parser.add_argument("--data-dir", required=True, help="etcd's data (and etcd.log); keep it across restarts")
    parser.add_argument("--client-port", type=int, default=2379)
    parser.add_argument("--peer-port", type=int, default=2380)
    parser.add_argument("--heartbeat-ms", type=int, default=100,
                        help="raft heartbeat; at least the round trip between the hosts")
    parser.add_argument("--election-timeout-ms", type=int, default=500,
                        help="raft election timeout; keep it at least ten heartbeats of the real round trip")
    parser.add_argument("--ready-timeout-s", type=float, default=60.0,
                        help="how long to wait for the cluster's leader before saying so (it keeps running)")
    parser.set_defaults(fn=cmd_etcd)


def cmd_etcd(args: argparse.Namespace) -> int:
    try:
        member = etcd.start_member(args.data_dir, name=args.name, initial_cluster=args.initial_cluster,
                                   listen_host=args.listen_host, advertise_host=args.advertise_host,
                                   client_port=args.client_port, peer_port=args.peer_port,
                                   heartbeat_ms=args.heartbeat_ms, election_timeout_ms=args.election_timeout_ms)
    except (ValueError, FileNotFoundError) as err:
        print(f"moemesh etcd: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"etcd member {args.name}: clients at {member.endpoint}, log {member.log_path}", flush=True)
    try:
        etcd.wait_healthy(member, args.ready_timeout_s)
        print(f"etcd member {args.name}: the cluster has a leader; serving", flush=True)
    except RuntimeError as err:
        if not member.is_running():
            print(f"moemesh etcd: {err}", file=sys.stderr)
            return 1
        print(f"moemesh etcd: no leader yet after {args.ready_timeout_s:.0f} s (are a majority of "
              f"{args.initial_cluster} running?); still waiting", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        if not member.is_running():
            print(f"moemesh etcd: etcd exited with {member.process.returncode}; log {member.log_path}",
                  file=sys.stderr)
            return 1
    member.stop()
    return 0
