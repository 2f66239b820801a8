"""`moemesh measure-links`: the exchange's link costs measured on a deployment, as an --ep-link-costs string.

One process per rank, started like a torch.distributed job on the nodes the
expert group will run on (the same GPUs, the same interface), e.g. two nodes
of 8 GPUs, node a at 10.0.0.1:

    # on node a (N=0) and on node b (N=1)
    for i in 0 1 2 3 4 5 6 7; do
      moemesh measure-links --init-method tcp://10.0.0.1:29600 --world-size 16 --rank $((8 * N + i)) \\
          --node $(hostname) --device cuda:$i --ep-interface eth0 &
    done; wait

or under torchrun (`torchrun --nnodes 2 --nproc-per-node 8 ... --no-python moemesh
measure-links --device cuda`: rank, world size, init method and the local GPU
come from its RANK, WORLD_SIZE, MASTER_ADDR and LOCAL_RANK). The backend is
gloo on the CPU, NCCL on CUDA; --ep-interface sets GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME as the expert service does (expert_svc/rendezvous.py).

The ranks tell each other their --node; ranks of one node measure the local
link in pairs, ranks of two nodes the network (services/model/exchange/
link_fit.py: link_pairs), each class's pairs at once. Every pair runs the
exchange's own collectives (ExpertComm's: all_to_all_single on gloo, also
all_gather and reduce_scatter on NCCL) at each size, the pairs in step
(a barrier per size). Rank 0 prints the times, the fitted latency and
bandwidth per link class, and last the `key=value,...` line to pass as
--ep-link-costs (MOEMESH_EP_LINK_COSTS) to every rank; --json writes it all.
"""

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist

from expert_svc.rendezvous import use_interface
from services import netaddr
from services.model.exchange import link_fit
from services.model.exchange.comm import ExpertComm


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeSettings:
    """One rank's part of a measurement; checked on construction (ValueError quoting the bad value)."""

    init_method: str  # tcp://HOST:PORT (rank 0's host) or env:// (torchrun)
    world_size: int
    rank: int
    node: str  # the machine: ranks with the same node measure the local link between them
    device: str = "cpu"  # "cpu", "cuda" (cuda:$LOCAL_RANK) or "cuda:N"
    interface: str = ""  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; empty: the libraries choose
    sizes: tuple[int, ...] = link_fit.DEFAULT_SIZES
    collectives: tuple[str, ...] = ()  # empty: the designs' collectives on this backend
    repeats: int = 5
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.init_method.startswith(("tcp://", "env://", "file://")):
            raise ValueError(f"init_method must be tcp://HOST:PORT, env:// or file://PATH, got {self.init_method!r}")
        if self.world_size < 2 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need a world size of at least 2 and a rank in it, got rank {self.rank} "
                             f"of {self.world_size}")
        if not self.node:
            raise ValueError("node must name this machine, got ''")
        if not (self.device in ("cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        unknown = [c for c in self.collectives if c not in link_fit.COLLECTIVES]
        if unknown:
            raise ValueError(f"collectives must be of {link_fit.COLLECTIVES}, got {unknown}")
        if self.repeats < 1 or self.timeout_s <= 0:
            raise ValueError(f"repeats must be >= 1 and timeout_s > 0, got {self.repeats}, {self.timeout_s}")
        if self.interface:
            netaddr.interface_address(self.interface)  # ValueError listing the interfaces here

    @property
    def backend(self) -> str:
        return "gloo" if self.device == "cpu" else "nccl"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device(self.device)

    @property
    def timed_collectives(self) -> tuple[str, ...]:
        return self.collectives or link_fit.COLLECTIVES_OF[self.backend]


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """What rank 0 gets: the ranks' nodes, the pairs of each class, and the fitted measurement."""

    nodes: tuple[str, ...]
    pairs: dict[str, tuple[tuple[int, int], ...]]
    measurement: link_fit.Measurement

    def report(self) -> str:
        """The printout: who measured what, the table, then the --ep-link-costs line alone."""
        pairs = "; ".join(f"{c}: {', '.join(f'{a}-{b}' for a, b in p)}" for c, p in self.pairs.items())
        return "\n".join([f"{len(self.nodes)} ranks on {len(set(self.nodes))} node(s) "
                          f"({', '.join(f'{r}:{n}' for r, n in enumerate(self.nodes))}); pairs {pairs}", "",
                          self.measurement.table(), "", "--ep-link-costs (MOEMESH_EP_LINK_COSTS):",
                          self.measurement.overrides_line()])

    def as_json(self) -> dict:
        return {"nodes": list(self.nodes), "pairs": {c: [list(p) for p in v] for c, v in self.pairs.items()},
                **self.measurement.as_json()}


def measure(settings: ProbeSettings) -> Result | None:
    """Joins the job, measures every link class, leaves it: the Result on rank 0, None elsewhere."""
    if settings.interface:
        use_interface(settings.interface, override=True)
    device = settings.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(settings.backend, init_method=settings.init_method, world_size=settings.world_size,
                            rank=settings.rank, timeout=datetime.timedelta(seconds=settings.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        nodes: list[str] = [""] * settings.world_size
        dist.all_gather_object(nodes, settings.node)
        pairs = link_fit.link_pairs(nodes)  # the same on every rank, so is an error
        times = {link_class: _measure_class(class_pairs, settings, device)
                 for link_class, class_pairs in pairs.items()}
        dist.barrier()  # every rank past its last collective before any tears the group down
    finally:
        dist.destroy_process_group()
    if settings.rank != 0:
        return None
    return Result(tuple(nodes), pairs, link_fit.Measurement.fitted(times))


def _measure_class(pairs: tuple[tuple[int, int], ...], settings: ProbeSettings,
                   device: torch.device) -> dict[str, dict[int, float]]:
    """Every pair of one link class at once: each collective at each size; the slowest pair's times."""
    groups = [dist.new_group(list(pair)) for pair in pairs]  # every rank creates every pair's group
    mine = next((ExpertComm(g) for pair, g in zip(pairs, groups) if settings.rank in pair), None)
    report: dict[str, dict[int, list[float]]] = {}
    for collective in settings.timed_collectives:
        for size in settings.sizes:
            dist.barrier()  # the pairs start each size together
            if mine is not None:
                report.setdefault(collective, {})[size] = _time(mine, collective, size, settings.repeats, device)
    reports: list[dict] = [{}] * settings.world_size
    dist.all_gather_object(reports, report)
    return link_fit.slowest(reports)


def _time(comm: ExpertComm, collective: str, size: int, repeats: int, device: torch.device) -> list[float]:
    """Seconds a call of the collective with `size` bytes to the peer, one value per repeat."""
    n = size // 4
    ins, outs = {"all_to_all": (2 * n, 2 * n), "all_gather": (n, 2 * n), "reduce_scatter": (2 * n, n)}[collective]
    inp, out = torch.ones(ins, device=device), torch.empty(outs, device=device)
    call, num_calls = getattr(comm, collective), link_fit.iterations(size)
    seconds = []
    for _ in range(repeats):
        call(out, inp)  # untimed: the two ranks leave it together
        _sync(device)
        started = time.perf_counter()
        for _ in range(num_calls):
            call(out, inp)
        _sync(device)
        seconds.append((time.perf_counter() - started) / num_calls)
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `moemesh measure-links` (and of `python -m moemesh.link_probe`)."""
    env = os.environ
    parser.add_argument("--init-method", default="env://" if env.get("MASTER_ADDR") else None,
                        help="tcp://HOST:PORT, rank 0's host and a free port, the same on every rank "
                             "(default under torchrun: env://)")
    parser.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", "0")),
                        help="how many processes measure (default: $WORLD_SIZE)")
    parser.add_argument("--rank", type=int, default=int(env.get("RANK", "-1")), help="this one (default: $RANK)")
    parser.add_argument("--node", default=socket.gethostname(),
                        help="this machine's name: ranks with the same node measure the local link "
                             "(default: the host name)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo), cuda (cuda:$LOCAL_RANK) or cuda:N (NCCL)")
    parser.add_argument("--ep-interface", default="", metavar="IFACE",
                        help="the network interface of the collective (GLOO/NCCL_SOCKET_IFNAME), as the experts'")
    parser.add_argument("--sizes", default=",".join(map(str, link_fit.DEFAULT_SIZES)),
                        help="bytes a rank sends its peer per call; the largest three fit the bandwidth")
    parser.add_argument("--collectives", default="", metavar="C1,C2",
                        help=f"of {','.join(link_fit.COLLECTIVES)} (default: the exchange designs' on the "
                             f"backend: all_to_all on gloo, all three on NCCL)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per size (their median counts)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="the rendezvous's and each collective's")
    parser.add_argument("--json", metavar="FILE", help="rank 0 also writes the measurement here")


def add_parser(sub) -> None:
    """Adds the `measure-links` subcommand to the subparsers of `moemesh`."""
    parser = sub.add_parser("measure-links", help="measure the expert exchange's links: an --ep-link-costs string")
    add_arguments(parser)
    parser.set_defaults(fn=cmd_measure_links)


def settings_of(args: argparse.Namespace) -> ProbeSettings:
    """ProbeSettings of the flags; ValueError naming a bad one."""
    if not args.init_method:
        raise ValueError("--init-method is required (tcp://HOST:PORT of rank 0's host), or run under torchrun")
    return ProbeSettings(init_method=args.init_method, world_size=args.world_size, rank=args.rank, node=args.node,
                         device=args.device, interface=args.ep_interface, sizes=link_fit.parse_sizes(args.sizes),
                         collectives=tuple(c.strip() for c in args.collectives.split(",") if c.strip()),
                         repeats=args.repeats, timeout_s=args.timeout_s)


def cmd_measure_links(args: argparse.Namespace) -> int:
    try:
        settings = settings_of(args)
    except ValueError as err:
        print(f"moemesh measure-links: {err}", file=sys.stderr)
        return 2
    # ExpertComm calls the collectives by their names of the torch the project pins, which warns.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated", category=FutureWarning)
    try:
        result = measure(settings)
    except ValueError as err:  # the ranks' nodes give no pair, or a fit fails
        print(f"moemesh measure-links: {err}", file=sys.stderr)
        return 1
    if result is not None:
        print(result.report(), flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result.as_json(), indent=1))
    return 0


def rank_command(init_method: str, world_size: int, rank: int, node: str, *flags: str) -> list[str]:
    """The command line of one rank of a measurement with this Python (`python -m moemesh.link_probe`)."""
    return [sys.executable, "-m", "moemesh.link_probe", "--init-method", init_method, "--world-size",
            str(world_size), "--rank", str(rank), "--node", node, *flags]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moemesh.link_probe", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return cmd_measure_links(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
