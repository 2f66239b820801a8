"""The production mix through the gateway's own scheduler against a modelled device, on the CPU.

    python -m bench.serving.sim_goodput --rates 10,12,14 --floor-ms 50 --decode-scale 2
    python -m bench.serving.sim_goodput --rates 8,11 --device-fit bench/results/goodput_nvidia-h100.json
    python -m bench.serving.sim_goodput --rates 12 --seeds 4 --device 15,5.0,1.2,9.4

Drives the pure batcher (gateway/batcher.py, the step budget and shedding included) with the
goodput bench's arrivals (the mix of bench/serving/workloads.py as a Poisson process, one rank)
and a simulated device: a step takes what the batcher's step-cost model's priors price it at
(gateway/step_cost.py), times --truth, with --noise relative jitter; a step with prefill at
least --floor-ms (an eager step's own cost), a decode-only step --decode-scale times the priors.
With --device-fit, the device is instead a measured one: a goodput result's logged prefill
steps fitted as the report fits them (fixed ms + us a prompt token + ns a token-context pair;
bench/serving/goodput.py fit_prefill_steps), its decode-only steps at their measured mean; with
--device, such a device given by hand (what a device that does not exist yet would have to be).
Two steps are in flight as with the engine's overlap: step k+1 is planned before step k's
results are applied. Per rate it prints the SLO attainment, TTFT and TPOT p50/p99 (as
bench/serving/goodput.py counts them: requests arriving in the first --settle-s are left out, a
refused one is a miss) and what the cost model learnt. It answers how the scheduler behaves
for a given device shape in seconds, not what a device does: that is bench/serving/goodput.py.
"""

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import random
import sys

from gateway.batcher import Batcher
from gateway.kv_accounting import RankKV
from gateway.requests import GenerationError, RequestOutput, Sequence
from gateway.stats import percentile
from gateway.step_cost import StepCost
from gateway.validation import ValidatedRequest
from bench.serving.workloads import make_workload
from services.step import GREEDY

_EOS = 0
# The host's share of a step between a result and the next plan, in seconds.
_HOST_S = 0.0003


@dataclasses.dataclass(frozen=True)
class FittedDevice:
    """A device priced as the goodput bench's fit prices its steps (from_result: fitted to a
    measured run; from_spec: given by hand): a step with prefill costs fixed_ms + us_per_token a
    prompt token + ns_per_pair a token-context pair; a decode-only step decode_ms."""

    fixed_ms: float
    us_per_token: float
    ns_per_pair: float
    decode_ms: float

    @classmethod
    def from_spec(cls, spec: str) -> "FittedDevice":
        """FIXED_MS,US_PER_TOKEN,NS_PER_PAIR,DECODE_MS, each a finite non-negative number (the fixed
        and decode-only parts positive)."""
        try:
            values = [float(v) for v in spec.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or not all(0 <= v < math.inf for v in values) or not (values[0] > 0 and values[3] > 0):
            raise ValueError(f"expected FIXED_MS,US_PER_TOKEN,NS_PER_PAIR,DECODE_MS (numbers, the first and last "
                             f"positive), got {spec!r}")
        return cls(*values)

    @classmethod
    def from_result(cls, path: pathlib.Path) -> "FittedDevice":
        """The fit of a goodput result JSON's logged prefill steps, every rate's pooled, and the
        mean of its decode-only steps (each rate's mean weighted by its decode-only steps)."""
        from bench.serving.goodput import fit_prefill_steps

        rates = json.loads(path.read_text())["mesh"]["cases"]["rates"]
        fit = fit_prefill_steps([s for r in rates for s in r["schedule"]["last_steps"]])
        if fit is None:
            raise ValueError(f"{path}: too few logged prefill steps to fit a device to")
        weights = [(r["schedule"]["steps"] * (1 - r["schedule"]["prefill_step_share"]), r["schedule"]["decode_step_ms"])
                   for r in rates if r["schedule"].get("decode_step_ms")]
        if not sum(w for w, _ in weights):
            raise ValueError(f"{path}: no decode-only steps measured to price them by")
        decode_ms = sum(w * ms for w, ms in weights) / sum(w for w, _ in weights)
        return cls(fit["fixed_ms"], fit["us_per_token"], fit["ns_per_pair"], round(decode_ms, 2))

    def step_ms(self, shape) -> float:
        if not shape.num_prefill_tokens:
            return self.decode_ms
        return self.fixed_ms + self.us_per_token * 1e-3 * shape.num_prefill_tokens + self.ns_per_pair * 1e-6 * shape.pairs


class _Detokenizer:
    """Text is not what is simulated: every token is one character."""

    def push(self, token_ids) -> str:
        return "x" * len(token_ids)

    def flush(self) -> str:
        return ""


def simulate(rate: float, args, seed: int = 0) -> dict:
    """The figures of one rate (see the module docstring)."""
    rng = random.Random(seed)
    now = [0.0]
    batcher = Batcher([RankKV(args.kv_blocks, 16, enable_prefix_cache=False)], max_running_requests=args.max_running,
                      max_batch_tokens=args.max_batch_tokens, max_context=65_536, eos_token_ids=[_EOS],
                      tpot_target_ms=args.tpot_target_ms, ttft_target_ms=args.ttft_target_ms,
                      # The step budget's configuration, as the goodput bench runs it; without it the default.
                      prefill_chunk_size=0 if args.tpot_target_ms else 512,
                      min_prefill_tokens=args.min_prefill_tokens, clock=lambda: now[0])
    device = StepCost()
    specs = make_workload("mix", max(1, round(rate * args.duration_s)), seed=seed)
    arrivals, t = [], 0.0
    for spec in specs:
        t += rng.expovariate(rate)
        arrivals.append((t, spec))
    records: dict[int, list] = {}   # seq_id -> [arrival, first token, end, output tokens]
    refused: list[float] = []
    in_flight: collections.deque = collections.deque()
    device_free, i = 0.0, 0
    while i < len(arrivals) or batcher.has_work or in_flight:
        while i < len(arrivals) and arrivals[i][0] <= now[0]:
            arrived, spec = arrivals[i]
            request = ValidatedRequest(f"r{i}", list(spec.prompt_ids), spec.max_new_tokens, GREEDY, (), True)
            seq = Sequence(batcher.new_seq_id(), request, _Detokenizer())
            try:
                batcher.add(seq)
                records[seq.seq_id] = [arrived, None, None, spec.max_new_tokens]
            except GenerationError:
                refused.append(arrived)
            i += 1
        if len(in_flight) < 2 and batcher.has_work:
            batch = batcher.schedule()
            if not batch.is_empty:
                price = args.fitted.step_ms if args.fitted else device.predict_ms
                shape = max(batcher.step_shapes(batch.step_id), key=price)
                if args.fitted:
                    ms = price(shape) * (1 + args.noise * rng.gauss(0, 1))
                else:
                    ms = args.truth * price(shape) * (1 + args.noise * rng.gauss(0, 1))
                    if shape.num_prefill_tokens:
                        ms = max(ms, args.floor_ms * (1 + args.noise * rng.gauss(0, 1)))
                    else:
                        ms = args.decode_scale * price(shape)
                device_free = max(now[0], device_free) + ms / 1e3
                in_flight.append((batch, ms, device_free))
                continue
        if in_flight:
            batch, ms, done_at = in_flight.popleft()
            now[0] = max(now[0], done_at) + _HOST_S
            tokens = {s.seq_id: 1 for p in batch.plans for s in p.scheduled if s.is_sampled}
            for seq, output in batcher.apply_results(batch.step_id, tokens, step_seconds=[ms / 1e3]):
                record = records[seq.seq_id]
                record[1] = record[1] if record[1] is not None else now[0]
                if isinstance(output, RequestOutput) and output.is_final:
                    record[2] = now[0]
        elif i < len(arrivals):
            now[0] = max(now[0], arrivals[i][0])
    counted = [r for r in records.values() if r[0] >= args.settle_s]
    ttft = [r[1] - r[0] for r in counted]
    tpot = [(r[2] - r[1]) / (r[3] - 1) for r in counted if r[3] > 1]
    met = sum(r[1] - r[0] <= args.slo_ttft_ms / 1e3 and (r[3] <= 1 or (r[2] - r[1]) / (r[3] - 1) <= args.slo_tpot_ms / 1e3)
              for r in counted)
    num_refused = sum(1 for arrived in refused if arrived >= args.settle_s)
    total = len(counted) + num_refused
    return {"rate": rate, "counted": total, "refused": num_refused,
            "slo_attainment": round(met / total, 4) if total else 0.0,
            "ttft_ms_p50": round(1e3 * percentile(ttft, 50)), "ttft_ms_p99": round(1e3 * percentile(ttft, 99)),
            "tpot_ms_p50": round(1e3 * percentile(tpot, 50), 1), "tpot_ms_p99": round(1e3 * percentile(tpot, 99), 1),
            "learnt": {"scale": round(batcher.cost.scale, 3), "floor_ms": round(batcher.cost.floor_ms, 1),
                       "decode_scale": round(batcher.cost.decode_scale, 2)}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.sim_goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="8,10,12,14", help="comma list of offered requests/s")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, default=1, help="runs per rate, each its own arrivals")
    parser.add_argument("--truth", type=float, default=1.0, help="the device's work against the model's priors")
    parser.add_argument("--floor-ms", type=float, default=0.0, help="the least a step with prefill takes")
    parser.add_argument("--decode-scale", type=float, default=1.0, help="decode-only steps against the priors")
    parser.add_argument("--noise", type=float, default=0.05, help="relative jitter of a step's time")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--device-fit", type=pathlib.Path, metavar="GOODPUT_JSON",
                       help="a measured device instead: a goodput result's steps fitted (--truth, --floor-ms and "
                            "--decode-scale then unused)")
    given.add_argument("--device", metavar="FIXED_MS,US,NS,DECODE_MS",
                       help="a device given by hand, as --device-fit prices one: a step with prefill FIXED_MS + US a "
                            "prompt token + NS a token-context pair, a decode-only step DECODE_MS (--truth, --floor-ms and "
                            "--decode-scale then unused)")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0)
    parser.add_argument("--tpot-target-ms", type=float, default=40.0,
                        help="the gateway's (0: its default scheduler, 512-token chunks)")
    parser.add_argument("--ttft-target-ms", type=float, default=500.0, help="the gateway's (0: no shedding)")
    parser.add_argument("--min-prefill-tokens", type=int, default=1024, help="the gateway's")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--kv-blocks", type=int, default=40_000, help="blocks of 16 tokens")
    args = parser.parse_args(argv)
    try:
        args.rate_list = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        parser.error(f"--rates must be numbers, got {args.rates!r}")
    if not args.rate_list or min(args.rate_list) <= 0 or args.settle_s >= args.duration_s:
        parser.error("--rates must be positive and --duration-s above --settle-s")
    args.fitted = None
    if args.device_fit:
        try:
            args.fitted = FittedDevice.from_result(args.device_fit)
        except (OSError, KeyError, ValueError) as error:
            parser.error(f"--device-fit: {error}")
    if args.device:
        try:
            args.fitted = FittedDevice.from_spec(args.device)
        except ValueError as error:
            parser.error(f"--device: {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fitted:
        print(f"device: {args.fitted}", flush=True)
    for rate in args.rate_list:
        for seed in range(args.seeds):
            print(simulate(rate, args, seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
