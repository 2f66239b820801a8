"""The ticket pipeline as a program against the same work as sequential plain Generate calls.

    python -m bench.programs.ticket --model DIR --num-tickets 100 --concurrency 1,16
    python -m bench.programs.ticket --target 127.0.0.1:50051          # a running mesh

Starts its own mesh (moemesh.launcher.Mesh, CPU, one rank) unless given one.
The program is examples/ticket_pipeline.py's `ticket`: classification
(select) and extraction (JSON schema) as two forks of the ticket, the
payment-API stand-in (--api-delay seconds) as soon as the order id is there,
then the answer. The sequential version makes the same calls one after the
other with the client, each sending the whole conversation: classify (the
categories as a choice constraint), extract (the same schema), the payment
API, answer. Per ticket: end-to-end latency; per run: p50/p99 at each
concurrency, and prompt tokens prefilled (prompt minus cached tokens, summed
over every request). Results: a table on stdout and programs_cpu.json / .md
under --out (default bench/results/).
"""

import argparse
import asyncio
import importlib.util
import json
import pathlib
import statistics
import sys
import time

import moemesh
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


async def program_ticket(session, pipeline, text: str, api_delay: float) -> tuple[float, int]:
    start = time.monotonic()
    state = await session.run(pipeline.ticket, (), {"text": text, "api_delay": api_delay})
    seconds = time.monotonic() - start
    usages = [node.usage for node in state.run_nodes() if node.usage is not None]
    return seconds, sum(u.prompt_tokens - u.cached_tokens for u in usages)


async def sequential_ticket(client, pipeline, text: str, api_delay: float) -> tuple[float, int]:
    start = time.monotonic()
    system = ("system", "You are a support agent. Be brief and polite.")
    messages = [system, ("user", text)]
    category = await client.generate(messages=messages, max_new_tokens=8, choice=list(pipeline.CATEGORIES))
    fields = await client.generate(messages=messages, max_new_tokens=96, json_schema=pipeline.FIELDS_SCHEMA)
    payment = await asyncio.to_thread(pipeline.payment_status, json.loads(fields.text)["order_id"], api_delay)
    follow_up = (f"Category: {category.text}\nPayment record: {json.dumps(payment)}\n"
                 "Write the answer to the customer.")
    answer = await client.generate(messages=[*messages, ("user", follow_up)], max_new_tokens=48)
    seconds = time.monotonic() - start
    usages = [r.usage for r in (category, fields, answer)]
    return seconds, sum(u.prompt_tokens - u.cached_tokens for u in usages)


async def measure(target: str, pipeline, texts: list[str], concurrency: int, api_delay: float, kind: str) -> dict:
    limit = asyncio.Semaphore(concurrency)
    runtime = moemesh.Runtime(target, timeout=600)
    async with Session(runtime, max_bodies=concurrency) as session:
        async def one(text: str):
            async with limit:
                if kind == "program":
                    return await program_ticket(session, pipeline, text, api_delay)
                return await sequential_ticket(session.client, pipeline, text, api_delay)
        start = time.monotonic()
        results = await asyncio.gather(*(one(t) for t in texts))
        wall = time.monotonic() - start
    latencies = sorted(seconds for seconds, _ in results)
    return {"kind": kind, "concurrency": concurrency, "num_tickets": len(texts), "wall_s": round(wall, 3),
            "p50_s": round(statistics.median(latencies), 3),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "prefilled_tokens": sum(tokens for _, tokens in results)}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.programs.ticket", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model dir of the mesh to start (unless --target)")
    parser.add_argument("--target", help="a running gateway's gRPC address")
    parser.add_argument("--num-tickets", type=int, default=100)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated")
    parser.add_argument("--api-delay", type=float, default=0.3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if (args.model is None) == (args.target is None):
        parser.error("exactly one of --model, --target")
    return args


def run(args, target: str) -> list[dict]:
    pipeline = load_pipeline()
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for kind in ("sequential", "program"):
            # Each run its own texts: a previous run's cached prompts would flatter the later one.
            texts = tickets(pipeline, args.num_tickets)
            texts = [f"{kind}-c{concurrency} {t}" for t in texts]
            rows.append(asyncio.run(measure(target, pipeline, texts, concurrency, args.api_delay, kind)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def write(args, rows: list[dict]) -> None:
    command = "python -m bench.programs.ticket " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "programs_cpu.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    lines = [f"# The ticket pipeline: program vs sequential Generate calls (CPU mesh)\n", f"`{command}`\n",
             "| version | concurrency | tickets | p50 s | p99 s | wall s | prompt tokens prefilled |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['concurrency']} | {r['num_tickets']} | {r['p50_s']} | {r['p99_s']} | "
              f"{r['wall_s']} | {r['prefilled_tokens']} |" for r in rows]
    (args.out / "programs_cpu.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.target:
        rows = run(args, args.target)
    else:
        with Mesh(MeshSpec(model_dir=args.model, num_ranks=1, device="cpu")) as mesh:
            rows = run(args, mesh.gateway_address)
    write(args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
