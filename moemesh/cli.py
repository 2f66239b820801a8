"""The `moemesh` command: up, etcd, generate, status, make-model, measure-links."""

import argparse
import json
import logging
import pathlib
import signal
import sys
import threading

import grpc

from moemesh import launcher, metrics_relay

DEFAULT_GATEWAY_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_MODEL_NAME = "tiny-seed0"


def default_model_dir(demo: pathlib.Path | None = None) -> str:
    """The model `moemesh up` serves without --model.

    The bundled demo model (`demo`, by default services/model/demo/, trained by
    the demo model pipeline; see docs/demo_model.md) when it is there, else a tiny
    random Qwen3-MoE generated on first use.
    """
    from services.model import make_model

    demo = demo or pathlib.Path(make_model.__file__).parent / "demo"
    if (demo / "config.json").is_file():
        return str(demo)
    path = launcher.cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        print(f"writing the default model to {path} ...", flush=True)
        tmp = path.with_name(path.name + ".tmp")
        make_model.make_random_checkpoint(tmp, make_model.PRESETS["tiny"], seed=0)
        tmp.rename(path)
    return str(path)


def mesh_spec(args: argparse.Namespace, model_dir: str) -> launcher.MeshSpec:
    """The MeshSpec of `moemesh up`'s flags; ValueError naming a bad one."""
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip()) if args.roles else launcher.ALL_ROLES
    member_tag = args.member_tag
    if member_tag is None:  # several hosts: ids that differ per host
        member_tag = "" if set(roles) == set(launcher.ALL_ROLES) else host_tag(args, roles)
    return launcher.MeshSpec(model_dir=model_dir, num_ranks=args.ranks, device=args.device,
                             gateway_port=args.port, http_port=args.http_port, etcd=args.etcd or "",
                             work_dir=args.work_dir or "", api_keys=args.api_keys or "",
                             data_plane_nice=args.data_plane_nice, tls=args.tls,
                             num_spare_expert_slots=args.num_spare_expert_slots, roles=roles,
                             bind_host=args.bind_host or "", advertise_host=args.advertise_host or "",
                             ep_interface=args.ep_interface or "", member_tag=member_tag)


def host_tag(args: argparse.Namespace, roles: tuple[str, ...]) -> str:
    """This host's part of its roles' member ids: the address they advertise, as 10-0-0-2."""
    from services import netaddr

    if args.advertise_host:
        host = args.advertise_host
    elif args.bind_host and not netaddr.is_wildcard(args.bind_host):
        host = args.bind_host
    elif args.ep_interface and "expert" in roles:
        host = netaddr.interface_address(args.ep_interface)
    else:
        etcd_hosts = [h for h, _ in netaddr.split_endpoints(args.etcd)] if args.etcd else ["127.0.0.1"]
        is_local = all(netaddr.is_loopback(h) for h in etcd_hosts)
        host = netaddr.default_advertise_host(args.bind_host or ("127.0.0.1" if is_local else "0.0.0.0"), etcd_hosts)
    return "".join(c if c.isalnum() else "-" for c in host).strip("-")


def cmd_up(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    try:
        spec = mesh_spec(args, model_dir)
    except ValueError as err:
        print(f"moemesh up: {err}", file=sys.stderr)
        return 2
    mesh = launcher.Mesh(spec)
    print(f"starting moemesh ({','.join(spec.roles)}): model {model_dir}, {args.ranks} rank(s) on {args.device}; "
          f"logs in {mesh.work_dir}" + (" (mutual TLS)" if args.tls else ""), flush=True)
    relay = None
    if args.metrics_port is not None:  # before the roles: /healthz answers, /readyz says who is still starting
        try:
            relay, url = metrics_relay.start_for_mesh(mesh, args.metrics_port)
        except ValueError as err:
            print(f"moemesh up: --metrics-port: {err}", file=sys.stderr)
            return 2
        print(f"metrics of the roles started here: {url}/metrics (and /healthz, /readyz)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return serve_mesh(mesh, stop)
    finally:
        if relay is not None:
            relay.stop()


def serve_mesh(mesh: launcher.Mesh, stop: threading.Event) -> int:
    """Starts the mesh, restarts the roles that exit until stop is set, then stops it; the exit status."""
    mesh.start()
    if mesh.has_gateway:
        http = f", {mesh.http_url} (OpenAI-compatible HTTP)" if mesh.http_url else ""
        print(f"moemesh is ready: gateway at {mesh.gateway_address} (gRPC){http}", flush=True)
        print(f"  try: moemesh generate --target {mesh.gateway_address} 'Hello, world!'", flush=True)
        print(f"       moemesh status", flush=True)
    else:
        print(f"moemesh is ready: {', '.join(r.name for r in mesh.roles)} registered in etcd at "
              f"{mesh.etcd_endpoint}", flush=True)
    print("Ctrl-C stops the mesh.", flush=True)
    try:
        while not stop.wait(0.5):
            for name in mesh.restart_exited():
                print(f"moemesh: {name} exited; restarted it", flush=True)
    except RuntimeError as err:
        print(f"moemesh: giving up: {err}", file=sys.stderr)
        mesh.stop()
        return 1
    print("stopping moemesh ...", flush=True)
    codes = mesh.stop()
    bad = {name: code for name, code in codes.items() if code != 0}
    print("stopped" + (f"; non-zero exits: {bad}" if bad else " cleanly"), flush=True)
    return 0


def _state() -> dict:
    if launcher.STATE_FILE.is_file():
        return json.loads(launcher.STATE_FILE.read_text())
    return {}


def tls_channel_args(args: argparse.Namespace, peer_role: str, state: dict | None = None) -> tuple:
    """(credentials, options) of a channel to peer_role: the operator's
    certificates of --tls-dir, else those of the mesh `moemesh up --tls`
    started when the target is one of its addresses (or none is given);
    (None, ()) for a plaintext mesh. ValueError for a directory without the files."""
    from services import tls

    state = _state() if state is None else state
    is_local = not args.target or args.target in (state.get("gateway"), *state.get("schedulers", []))
    tls_dir = args.tls_dir or (state.get("tls_dir") if is_local else None)
    if not tls_dir:
        return None, ()
    files = tls.TlsFiles.from_dir(tls_dir)
    return tls.channel_credentials(files), tls.channel_options(peer_role)


def generate_arguments(args: argparse.Namespace) -> dict:
    """Client.stream's keyword arguments of `moemesh generate`'s flags; ValueError for an unreadable --json-schema."""
    kwargs = dict(request_id=args.request_id, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or [], priority=args.priority)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    if args.json_schema is not None:
        try:
            kwargs["json_schema"] = pathlib.Path(args.json_schema).read_text()
        except OSError as err:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {err.strerror}") from err
    elif args.regex is not None:
        kwargs["regex"] = args.regex
    elif args.choice is not None:
        # The gateway refuses an empty option, naming it.
        kwargs["choice"] = args.choice.split(",")
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from moemesh.client import Client
    from moemesh.client_errors import MoemeshError
    from moemesh.client_types import Usage

    target = args.target or _state().get("gateway") or f"127.0.0.1:{DEFAULT_GATEWAY_PORT}"
    try:
        kwargs = generate_arguments(args)
    except ValueError as err:
        print(f"moemesh generate: {err}", file=sys.stderr)
        return 2
    last = None
    try:
        credentials, options = tls_channel_args(args, "gateway")
    except ValueError as err:
        print(f"moemesh generate: {err}", file=sys.stderr)
        return 2
    # The key comes from $MOEMESH_API_KEY (never a flag: flags show in `ps` and shell history).
    with Client(target, timeout=args.timeout, credentials=credentials, options=options) as client:
        try:
            for chunk in client.stream(**kwargs):
                print(chunk.text, end="", flush=True)
                last = chunk
        except MoemeshError as err:
            print(f"\nerror: {err.code.name}: {err.details}", file=sys.stderr)
            return 1
    if last is not None:
        usage = last.usage or Usage(0, 0)
        print(f"\n[FINISH_REASON_{(last.finish_reason or 'unspecified').upper()}, prompt {usage.prompt_tokens} "
              f"tokens, completion {usage.completion_tokens} tokens]", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    targets = [args.target] if args.target else _state().get("schedulers", [])
    if not targets:
        print("no mesh found: start one with `moemesh up` or pass --target SCHEDULER_ADDR", file=sys.stderr)
        return 1
    try:
        credentials, options = tls_channel_args(args, "scheduler")
    except ValueError as err:
        print(f"moemesh status: {err}", file=sys.stderr)
        return 2
    for target in targets:
        with (grpc.secure_channel(target, credentials, options=options) if credentials
              else grpc.insecure_channel(target)) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            try:
                state = stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=3)
            except grpc.RpcError as err:
                print(f"{target}: {err.code().name}: {err.details()}", file=sys.stderr)
                continue
        print(format_state(state))
        return 0
    return 1


def format_state(state) -> str:
    """Human-readable cluster state."""
    from moe.scheduler.v1 import scheduler_pb2

    lines = []
    if state.HasField("leader"):
        ld = state.leader
        lines.append(f"leader: {ld.member_id} at {ld.address}, term {ld.term}, elected_at {ld.elected_at_unix:.3f}")
    else:
        lines.append("leader: none")
    lines.append(f"answered by: {state.replica_id} ({'leader' if state.is_leader else 'follower'})")
    lines.append("members:")
    for m in sorted(state.members, key=lambda m: (m.role, m.member_id)):
        role = scheduler_pb2.MemberRole.Name(m.role).removeprefix("MEMBER_ROLE_").lower()
        lines.append(f"  {role:<9} {m.member_id:<14} {m.address}")
    lines.append("groups:")
    for g in state.groups:
        lines.append(f"  {g.group_id}: epoch {g.placement_epoch}, term {g.term}, gateway {g.gateway_id or '-'}, "
                     f"rendezvous {g.rendezvous_address}")
        for r in g.ranks:
            lines.append(f"    rank {r.rank}: {r.member_id} at {r.address} "
                         f"{'ready' if r.is_ready else 'not ready'}")
    return "\n".join(lines)


def cmd_make_model(args: argparse.Namespace) -> int:
    from services.model import make_model

    make_model.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh", description="Serve Qwen3-MoE models as a mesh of gRPC services.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole mesh on this machine")
    up.add_argument("--model", help="checkpoint directory (default: the bundled tiny model)")
    up.add_argument("--ranks", type=int, default=1, help="expert services in the group")
    up.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    up.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port (0 = any free port)")
    up.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                    help="port of the OpenAI-compatible HTTP endpoint (0 = any free port, -1 = off)")
    up.add_argument("--etcd", help="use this etcd (host:port, or h1:2379,h2:2379,h3:2379 for a cluster) "
                                   "instead of starting one")
    up.add_argument("--roles", metavar="R1,R2",
                    help=f"start only these roles here, of {','.join(launcher.ALL_ROLES)} (default: all); the "
                         "others run on other hosts on the same --etcd (docs/deploy.md, \"Many hosts\"). "
                         "--ranks is then the group size of the schedulers and the expert services started here")
    up.add_argument("--bind-host", help="every role's --bind-host (0.0.0.0: every interface; default: 127.0.0.1 "
                                        "with a local etcd, else 0.0.0.0)")
    up.add_argument("--advertise-host", help="every role's --advertise-host: the address other hosts reach this "
                                             "one at (default: this host's address towards etcd)")
    up.add_argument("--ep-interface", metavar="IFACE",
                    help="the network interface of the expert services' collective (GLOO/NCCL_SOCKET_IFNAME)")
    up.add_argument("--member-tag", help="appended to the member ids of the roles started here (expert-TAG-0); "
                                         "default with --roles: the advertised address, e.g. 10-0-0-2")
    up.add_argument("--api-keys", metavar="FILE",
                    help="client API keys (docs/security.md); `moemesh generate` then reads $MOEMESH_API_KEY")
    up.add_argument("--work-dir", help="where logs and etcd data go (default: a temporary directory)")
    up.add_argument("--data-plane-nice", type=int, default=launcher.DEFAULT_DATA_PLANE_NICE,
                    help="niceness of the router, expert services and gateways, so that etcd and the "
                         "schedulers get the CPU first on a shared host (0 = none)")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS between every role and etcd, with a throwaway CA and certificates in the "
                         "work dir; `generate` and `status` use them (docs/security.md)")
    up.add_argument("--num-spare-expert-slots", default="auto", metavar="auto|N",
                    help="spare expert slots per MoE layer for replicas of hot experts: auto sizes them from "
                         "memory (none with one rank), N reserves N, 0 turns replicas off (default: auto)")
    up.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="serve every role's /metrics here as one, each sample labelled member=<member id>, and "
                         "/healthz, /readyz (200 when every role is ready) on PORT, 0 = a free one, on --bind-host "
                         "(moemesh/metrics_relay.py; default: off)")
    up.set_defaults(fn=cmd_up)

    from moemesh import etcd_cli

    etcd_cli.add_parser(sub)

    gen = sub.add_parser("generate", help="stream a completion from the gateway")
    gen.add_argument("prompt")
    gen.add_argument("--target", help="gateway address (default: the mesh `moemesh up` started)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--request-id", default="cli")
    gen.add_argument("--priority", choices=["interactive", "batch"], default="interactive",
                     help="the request's class (the gateway admits interactive requests first)")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema")
    constraint.add_argument("--regex", metavar="R", help="the whole output matches this regex (Rust regex syntax)")
    constraint.add_argument("--choice", metavar="A,B,C",
                            help="the output is exactly one of these comma-separated texts")
    gen.add_argument("--timeout", type=float, default=300.0)
    gen.add_argument("--tls-dir", help="ca.crt, tls.crt, tls.key to call a TLS gateway with "
                                       "(default: those of the mesh `moemesh up --tls` started)")
    gen.set_defaults(fn=cmd_generate)

    status = sub.add_parser("status", help="show the scheduler leader, groups, ranks and their state")
    status.add_argument("--target", help="a scheduler address (default: the mesh `moemesh up` started)")
    status.add_argument("--tls-dir", help="the operator's ca.crt, tls.crt, tls.key for a TLS mesh "
                                          "(default: those of the mesh `moemesh up --tls` started)")
    status.set_defaults(fn=cmd_status)

    make = sub.add_parser("make-model", help="write a random Qwen3-MoE checkpoint in the hub layout")
    from services.model import make_model

    make_model.add_arguments(make)
    make.set_defaults(fn=cmd_make_model)

    from moemesh import link_probe

    link_probe.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
