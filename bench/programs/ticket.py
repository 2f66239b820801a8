"""The ticket pipeline as a program against the same work as sequential plain Generate calls.

    python -m bench.programs.ticket --num-tickets 100 --concurrency 1,16     # the demo model, CPU
    python -m bench.programs.ticket --device cuda --out DIR                  # the same on one GPU
    python -m bench.programs.ticket --target 127.0.0.1:50051                 # a running mesh

Starts its own mesh (moemesh.launcher.Mesh, one rank on --device) on --model,
by default the model `moemesh up` serves (the bundled demo model), unless
given --target. The program is examples/ticket_pipeline.py's `ticket`:
classification (select) and extraction (JSON schema) as two forks of the
ticket, the payment-API stand-in (--api-delay seconds) as soon as the order id
is there, then the answer. The sequential version makes the same calls one
after the other with the client, each sending the whole conversation:
classify (the categories as a choice constraint), extract (the same schema),
the payment API, answer. The two versions take turns (--rounds batches of the
tickets each, at the same concurrency), so that a shared host's load falls on
both alike. Per ticket: end-to-end latency; per version and concurrency:
p50/p99, prompt tokens prefilled (prompt minus cached tokens, summed over
every request), the answers' tokens (the two versions' answer prompts are
tokenized differently, so their answers may differ in length; --answer-tokens
makes every answer that long, for equal work), and the
program's mean seconds per node (from its submission, inputs' wait
included). Results: a table on stdout and programs_<device>.json / .md under
--out (default bench/results/), one file per device: a run merges into the
file it finds there by (answer length setting, version, concurrency), its rows
replacing those of earlier runs, the others kept; each row names its run
("run": an index into "runs", which keeps every run's command and commit).
"""

import argparse
import asyncio
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import time

import moemesh
from bench.serving.serve import write_result
from moemesh.cli import default_model_dir
from moemesh.launcher import Mesh, MeshSpec
from moemesh.program.runtime import Session

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"


def load_pipeline():
    spec = importlib.util.spec_from_file_location("ticket_pipeline", ROOT / "examples" / "ticket_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tickets(pipeline, num: int) -> list[str]:
    # Distinct texts, so the prefix cache helps within a ticket, not across tickets.
    return [f"[#{i}] {pipeline.TICKETS[i % len(pipeline.TICKETS)]}" for i in range(num)]


async def program_ticket(session, pipeline, text: str, api_delay: float,
                         answer_tokens: int | None) -> tuple[float, int, int, dict]:
    start = time.monotonic()
    fixed = {} if answer_tokens is None else {"max_answer_tokens": answer_tokens, "fixed_answer": True}
    state = await session.run(pipeline.ticket, (), {"text": text, "api_delay": api_delay, **fixed})
    seconds = time.monotonic() - start
    nodes = state.run_nodes()
    usages = [node.usage for node in nodes if node.usage is not None]
    prefilled = sum(u.prompt_tokens - u.cached_tokens for u in usages)
    return seconds, prefilled, state.node("answer").usage.completion_tokens, {n.name: n.seconds for n in nodes}


async def sequential_ticket(client, pipeline, text: str, api_delay: float,
                            answer_tokens: int | None) -> tuple[float, int, int, dict]:
    start = time.monotonic()
    system = ("system", "You are a support agent. Be brief and polite.")
    messages = [system, ("user", text)]
    category = await client.generate(messages=messages, max_new_tokens=8, choice=list(pipeline.CATEGORIES))
    fields = await client.generate(messages=messages, max_new_tokens=96, json_schema=pipeline.FIELDS_SCHEMA)
    payment = await asyncio.to_thread(pipeline.payment_status, json.loads(fields.text)["order_id"], api_delay)
    follow_up = (f"Category: {category.text}\nPayment record: {json.dumps(payment)}\n"
                 "Write the answer to the customer.")
    length = {"max_new_tokens": 48} if answer_tokens is None else {"max_new_tokens": answer_tokens, "ignore_eos": True}
    answer = await client.generate(messages=[*messages, ("user", follow_up)], **length)
    seconds = time.monotonic() - start
    usages = [r.usage for r in (category, fields, answer)]
    return seconds, sum(u.prompt_tokens - u.cached_tokens for u in usages), answer.usage.completion_tokens, {}


async def measure(target: str, pipeline, texts: list[str], concurrency: int, api_delay: float,
                  answer_tokens: int | None, kind: str) -> tuple[float, list]:
    """(wall seconds, each ticket's (seconds, prefilled, answer tokens, seconds per node)) of one batch."""
    limit = asyncio.Semaphore(concurrency)
    runtime = moemesh.Runtime(target, timeout=600)
    async with Session(runtime, max_bodies=concurrency) as session:
        async def one(text: str):
            async with limit:
                if kind == "program":
                    return await program_ticket(session, pipeline, text, api_delay, answer_tokens)
                return await sequential_ticket(session.client, pipeline, text, api_delay, answer_tokens)
        start = time.monotonic()
        results = await asyncio.gather(*(one(t) for t in texts))
        return time.monotonic() - start, list(results)


def summarize(kind: str, concurrency: int, wall: float, results: list) -> dict:
    latencies = sorted(r[0] for r in results)
    nodes = sorted({name for *_, per_node in results for name in per_node})
    return {"kind": kind, "concurrency": concurrency, "num_tickets": len(results), "wall_s": round(wall, 3),
            "p50_s": round(statistics.median(latencies), 3),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "prefilled_tokens": sum(r[1] for r in results), "answer_tokens": sum(r[2] for r in results),
            "node_mean_s": {name: round(statistics.mean(r[3][name] for r in results if name in r[3]), 3)
                            for name in nodes}}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.programs.ticket", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model dir of the mesh to start (default: the demo model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the started mesh's device")
    parser.add_argument("--target", help="a running gateway's gRPC address (instead of starting a mesh)")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0, help="for the started mesh to serve")
    parser.add_argument("--num-tickets", default="100",
                        help="tickets per run: one number, or one per --concurrency (comma-separated)")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated")
    parser.add_argument("--api-delay", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=5, help="batches per version and concurrency, in turns")
    parser.add_argument("--answer-tokens", type=int,
                        help="every answer exactly this long (end-of-sequence ignored): equal work in both versions; "
                             "its rows sit beside the free-length ones in programs_<device>")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.model is not None and args.target is not None:
        parser.error("at most one of --model, --target")
    return args


def run(args, target: str) -> list[dict]:
    pipeline = load_pipeline()
    rows = []
    loads = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.num_tickets.split(",")]
    if len(counts) not in (1, len(loads)):
        raise SystemExit(f"--num-tickets: one number or one per concurrency, got {args.num_tickets}")
    for concurrency, num_tickets in zip(loads, counts * len(loads) if len(counts) == 1 else counts):
        walls, results = {"sequential": 0.0, "program": 0.0}, {"sequential": [], "program": []}
        # The versions take turns, --rounds batches each, so that both see the host's load alike.
        rounds = min(args.rounds, num_tickets)
        for round_index in range(rounds):
            batch = tickets(pipeline, num_tickets)[round_index::rounds]
            for kind in walls:
                # Each run its own texts: a previous run's cached prompts would flatter the later one.
                texts = [f"{kind}-c{concurrency}-r{round_index} {t}" for t in batch]
                wall, measured = asyncio.run(measure(target, pipeline, texts, concurrency, args.api_delay,
                                                     args.answer_tokens, kind))
                walls[kind] += wall
                results[kind] += measured
        for kind in walls:
            rows.append(summarize(kind, concurrency, walls[kind], results[kind]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def answers_text(answers: int | None) -> str:
    return "up to 48 tokens (end-of-sequence ends them)" if answers is None else f"exactly {answers} tokens"


def _row_order(row: dict) -> tuple:
    """Rows by answer setting (free-length first), concurrency, then sequential before program."""
    return row["answers"] is not None, row["answers"] or 0, row["concurrency"], row["kind"] != "sequential"


def normalized(report: dict, answers: int | None = None) -> dict:
    """A result in the merged form ("runs", each row naming its run and its answer setting); a
    result written before results merged (one run, whose --answer-tokens was `answers`) becomes
    that one run."""
    if "runs" in report:
        return report
    run = {k: report[k] for k in ("command", "commit", "model", "device") if k in report}
    run.update(answers=answers, **{k: report[k] for k in ("note",) if k in report})
    return {**report, "runs": [run], "rows": [{**r, "answers": answers, "run": 0} for r in report["rows"]]}


def merged(old: dict | None, new: dict) -> dict:
    """`new` (one run) merged into `old`: its rows replace old's of the same answer setting,
    version and concurrency; old's other rows stay."""
    new = normalized(new)
    if old is None:
        return new
    old = normalized(old)
    offset = len(old["runs"])
    rows = [{**r, "run": r["run"] + offset} for r in new["rows"]]
    taken = {(r["answers"], r["kind"], r["concurrency"]) for r in rows}
    rows += [r for r in old["rows"] if (r["answers"], r["kind"], r["concurrency"]) not in taken]
    return {**new, "runs": old["runs"] + new["runs"], "rows": sorted(rows, key=_row_order)}


def markdown(report: dict) -> str:
    lines = [f"# The ticket pipeline: program vs sequential Generate calls ({report['device']})\n",
             "Runs (each row names its run):\n"]
    for i, run in enumerate(report["runs"]):
        note = f" {run['note']}." if run.get("note") else ""
        lines.append(f"- run {i}: `{run['command']}`; commit {run['commit']}.{note} Model: {run['model']}; "
                     f"api delay {run.get('api_delay', 0.3)} s; answers {answers_text(run['answers'])}.")
    for answers in sorted({r["answers"] for r in report["rows"]}, key=lambda a: (a is not None, a or 0)):
        rows = [r for r in report["rows"] if r["answers"] == answers]
        lines += ["", f"## Answers {answers_text(answers)}\n",
                  "| version | concurrency | tickets | p50 s | p99 s | wall s | prompt tokens prefilled | "
                  "answer tokens | run |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['concurrency']} | {r['num_tickets']} | {r['p50_s']} | {r['p99_s']} | "
                  f"{r['wall_s']} | {r['prefilled_tokens']} | {r['answer_tokens']} | {r['run']} |" for r in rows]
        by_load = {(r["kind"], r["concurrency"]): r for r in rows}
        lines += ["", "| concurrency | program p50 / sequential p50 | program's mean s per node |", "|---|---|---|"]
        for concurrency in sorted({c for _, c in by_load}):
            program, sequential = by_load.get(("program", concurrency)), by_load.get(("sequential", concurrency))
            if program and sequential:
                nodes = ", ".join(f"{k} {v}" for k, v in program["node_mean_s"].items())
                lines.append(f"| {concurrency} | {program['p50_s'] / sequential['p50_s']:.2f} | {nodes} |")
    return "\n".join(lines) + "\n"


def write(args, rows: list[dict], model: str) -> None:
    command = "python -m bench.programs.ticket " + " ".join(sys.argv[1:])
    name = f"programs_{args.device}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    run = {"command": command, "commit": commit, "model": model, "device": args.device,
           "api_delay": args.api_delay, "answers": args.answer_tokens,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path = args.out / f"{name}.json"
    new = {**{k: run[k] for k in ("command", "commit", "model", "device")}, "runs": [run],
           "rows": [{**r, "answers": args.answer_tokens, "run": 0} for r in rows]}
    report = merged(json.loads(path.read_text()) if path.is_file() else None, new)
    write_result(args.out, name, report, markdown(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.target:
        rows = run(args, args.target)
        model = f"the mesh at {args.target}"
    else:
        model = args.model or default_model_dir()
        with Mesh(MeshSpec(model_dir=model, num_ranks=1, device=args.device,
                           ready_timeout_s=args.ready_timeout_s)) as mesh:
            rows = run(args, mesh.gateway_address)
        model = str(pathlib.Path(model).resolve().relative_to(ROOT)) if pathlib.Path(model).resolve().is_relative_to(
            ROOT) else model
    write(args, rows, model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
