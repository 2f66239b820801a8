"""The OpenAI-compatible HTTP endpoint under load, against gRPC on the same mesh.

    python -m bench.serving.http_load --model DIR --num-requests 256 --concurrency 32
    python -m bench.serving.http_load --grpc 127.0.0.1:50051 --http http://127.0.0.1:8000/v1   # a running mesh

Starts its own mesh (moemesh.launcher.Mesh, CPU) unless given one. Every
request is greedy with ignore_eos and --max-new-tokens tokens, over a few
prompts, streamed (gRPC Generate; HTTP /v1/completions with stream: true and
vLLM's return_token_ids, read with a minimal HTTP/1.1 client on one
keep-alive connection per worker, so that client libraries add nothing).
The reference of each prompt is its gRPC answer on the idle mesh first.

Two measurements:
- loaded: --rounds rounds, each --num-requests requests through gRPC and the
  same through HTTP at the same time, each closed loop at --concurrency (so
  both share the mesh's steps and the machine's load, which on a shared host
  drifts too much between phases run one after the other); E2E and TTFT
  percentiles per transport, and HTTP minus gRPC at p50 and p99.
- paired: --num-paired requests one at a time, each prompt through gRPC then
  HTTP back to back on the idle mesh; the per-request difference of their E2E
  latencies (the HTTP layer's added latency per request) at p50 and p99.

No request may be lost: each ends with a finish reason and exactly the
reference tokens, or the run fails. Results: a table on stdout and
http_load_cpu.json / .md under --out (default bench/results/).
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import shlex
import subprocess
import sys
import time

import grpc

from bench.serving.serve import RESULTS_DIR, write_result
from gateway.stats import percentile
from moe.gateway.v1 import gateway_pb2, gateway_pb2_grpc

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.",
           "Mixture-of-experts models route each token to a few experts.", "def fibonacci(n):",
           "In 1905, Albert Einstein published four papers that changed physics."]


@dataclasses.dataclass(slots=True)
class Result:
    """One request: its tokens, whether it finished, and when (seconds from its start)."""

    token_ids: list[int]
    is_finished: bool
    ttft_s: float
    e2e_s: float


async def grpc_request(stub, prompt: str, max_new_tokens: int) -> Result:
    request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=gateway_pb2.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    start, ttft, token_ids, finish = time.perf_counter(), 0.0, [], 0
    async for response in stub.Generate(request, timeout=300):
        if response.token_ids and not token_ids:
            ttft = time.perf_counter() - start
        token_ids += response.token_ids
        finish = response.finish_reason
    return Result(token_ids, finish != gateway_pb2.FINISH_REASON_UNSPECIFIED, ttft, time.perf_counter() - start)


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads server-sent events."""

    def __init__(self, url: str) -> None:
        host_port, _, path = url.removeprefix("http://").partition("/")
        self.host, port = host_port.split(":")
        self.port, self.prefix = int(port), "/" + path.rstrip("/")
        self._reader = self._writer = None

    async def events(self, path: str, body: dict):
        """Yields each `data:` payload of the response to POST path (decoded JSON, or "[DONE]")."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self._writer.write(f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                           f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await self._reader.readuntil(b"\r\n\r\n")).decode()
        status = int(head.split(" ", 2)[1])
        if status != 200 or "chunked" not in head.lower():
            raise RuntimeError(f"HTTP {status}: {head!r}")
        buffer = b""
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await self._reader.readexactly(size + 2)
            if size == 0:
                return
            buffer += chunk[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)

    async def close(self) -> None:
        """Closes the connection (the next request opens a new one)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def http_request(connection: HttpConnection, prompt: str, max_new_tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start, ttft, token_ids, finish = time.perf_counter(), 0.0, [], None
    try:
        async for event in connection.events("/completions", body):
            if event == "[DONE]":
                continue
            if "error" in event:
                raise RuntimeError(event["error"])
            choice = event["choices"][0]
            if choice["token_ids"] and not token_ids:
                ttft = time.perf_counter() - start
            token_ids += choice["token_ids"]
            finish = choice["finish_reason"] or finish
    except BaseException:
        await connection.close()  # whatever is left of the response must not be read as the next one's
        raise
    return Result(token_ids, finish is not None, ttft, time.perf_counter() - start)


async def close_all(connections: list[HttpConnection]) -> None:
    """Closes every connection: uvicorn closes keep-alive connections idle for 5 s, so each phase opens its own."""
    for connection in connections:
        await connection.close()


async def closed_loop(send, num_workers: int, prompts: list[str]) -> list[tuple[str, Result | BaseException]]:
    """Sends every prompt with num_workers requests in flight; send(worker, prompt) -> Result."""
    queue = list(reversed(prompts))
    results = []

    async def worker(index: int) -> None:
        while queue:
            prompt = queue.pop()
            try:
                results.append((prompt, await send(index, prompt)))
            except (grpc.aio.AioRpcError, RuntimeError, OSError, asyncio.IncompleteReadError) as error:
                results.append((prompt, error))

    await asyncio.gather(*(worker(i) for i in range(num_workers)))
    return results


def summarize(results, references: dict[str, list[int]], wall_s: float) -> dict:
    done = [r for _, r in results if isinstance(r, Result)]
    wrong = sum(1 for p, r in results if isinstance(r, Result) and (not r.is_finished or r.token_ids != references[p]))
    e2e, ttft = [r.e2e_s * 1e3 for r in done], [r.ttft_s * 1e3 for r in done]
    return {"num_sent": len(results), "num_completed": len(done) - wrong, "num_lost": len(results) - len(done),
            "num_wrong": wrong, "errors": sorted({repr(r)[:200] for _, r in results if not isinstance(r, Result)}),
            "e2e_ms_p50": percentile(e2e, 50), "e2e_ms_p99": percentile(e2e, 99),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "out_tok_s": sum(len(r.token_ids) for r in done) / wall_s}


async def run(grpc_address: str, http_url: str, args) -> dict:
    channel = grpc.aio.insecure_channel(grpc_address)
    stub = gateway_pb2_grpc.GenerationServiceStub(channel)
    connections = [HttpConnection(http_url) for _ in range(max(args.concurrency, 1))]
    try:
        references = {p: (await grpc_request(stub, p, args.max_new_tokens)).token_ids for p in PROMPTS}
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
        senders = {"grpc": lambda _, p: grpc_request(stub, p, args.max_new_tokens),
                   "http": lambda i, p: http_request(connections[i], p, args.max_new_tokens)}
        loaded = {name: [] for name in senders}
        walls = {name: 0.0 for name in senders}
        for _ in range(args.rounds):
            await close_all(connections)
            start = time.perf_counter()
            rounds = await asyncio.gather(*(closed_loop(send, args.concurrency, prompts) for send in senders.values()))
            for name, results in zip(senders, rounds):
                loaded[name] += results
                walls[name] += time.perf_counter() - start
        await close_all(connections)
        paired, differences = {name: [] for name in senders}, []
        for i in range(args.num_paired):
            prompt = PROMPTS[i % len(PROMPTS)]
            pair = [(await closed_loop(send, 1, [prompt]))[0] for send in senders.values()]
            for name, item in zip(senders, pair):
                paired[name].append(item)
            if all(isinstance(r, Result) for _, r in pair):
                differences.append((pair[1][1].e2e_s - pair[0][1].e2e_s) * 1e3)
    finally:
        await channel.close()
        await close_all(connections)
    report = {"loaded": {name: summarize(loaded[name], references, walls[name]) for name in senders},
              "paired": {name: summarize(paired[name], references, 1.0) for name in senders}}
    grpc_s, http_s = report["loaded"]["grpc"], report["loaded"]["http"]
    report["added_ms"] = {
        "loaded_e2e_p50": http_s["e2e_ms_p50"] - grpc_s["e2e_ms_p50"],
        "loaded_e2e_p99": http_s["e2e_ms_p99"] - grpc_s["e2e_ms_p99"],
        "loaded_ttft_p50": http_s["ttft_ms_p50"] - grpc_s["ttft_ms_p50"],
        "loaded_ttft_p99": http_s["ttft_ms_p99"] - grpc_s["ttft_ms_p99"],
        "paired_e2e_p50": percentile(differences, 50), "paired_e2e_p99": percentile(differences, 99)}
    for part in report["paired"].values():
        del part["out_tok_s"]  # one request at a time: not a throughput
    return report


def markdown(report: dict) -> str:
    rows = ["| phase | transport | sent | completed | lost | wrong | E2E p50/p99 ms | TTFT p50/p99 ms | out tok/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for phase in ("loaded", "paired"):
        for name, s in report[phase].items():
            rows.append(f"| {phase} | {name} | {s['num_sent']} | {s['num_completed']} | {s['num_lost']} | "
                        f"{s['num_wrong']} | {s['e2e_ms_p50']:.1f} / {s['e2e_ms_p99']:.1f} | "
                        f"{s['ttft_ms_p50']:.1f} / {s['ttft_ms_p99']:.1f} | "
                        f"{format(s['out_tok_s'], '.1f') if 'out_tok_s' in s else '-'} |")
    added = report["added_ms"]
    rows += ["", "| HTTP minus gRPC (ms) | p50 | p99 |", "|---|---|---|",
             f"| loaded E2E | {added['loaded_e2e_p50']:+.2f} | {added['loaded_e2e_p99']:+.2f} |",
             f"| loaded TTFT | {added['loaded_ttft_p50']:+.2f} | {added['loaded_ttft_p99']:+.2f} |",
             f"| paired E2E, per request | {added['paired_e2e_p50']:+.2f} | {added['paired_e2e_p99']:+.2f} |"]
    return "\n".join(rows)


def problems(report: dict) -> list[str]:
    found = []
    for phase in ("loaded", "paired"):
        for name, s in report[phase].items():
            if s["num_lost"] or s["num_wrong"]:
                found.append(f"{phase} {name}: {s['num_lost']} lost, {s['num_wrong']} wrong {s['errors']}")
    return found


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.http_load", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory of the mesh to start (without --grpc/--http)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--grpc", help="the gateway's gRPC address of a running mesh")
    parser.add_argument("--http", help="its OpenAI-compatible base URL, http://HOST:PORT/v1")
    parser.add_argument("--num-requests", type=int, default=256, help="requests per transport and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-paired", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if (args.grpc is None) != (args.http is None) or (args.grpc is None and not args.model):
        parser.error("give --model (a mesh is started), or both --grpc and --http")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    load_start = os.getloadavg()
    if args.grpc is not None:
        report = asyncio.run(run(args.grpc, args.http, args))
    else:
        from moemesh.launcher import Mesh, MeshSpec

        with Mesh(MeshSpec(model_dir=args.model, num_ranks=args.ranks)) as mesh:
            report = asyncio.run(run(mesh.gateway_address, mesh.http_url, args))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent).stdout.strip()
    report = {"command": shlex.join(["python", "-m", "bench.serving.http_load", *argv]), "commit": commit,
              "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
              "machine": {"cpus": os.cpu_count(), "load_start": [round(x, 2) for x in load_start],
                          "load_end": [round(x, 2) for x in os.getloadavg()]},
              **report, "problems": None}
    report["problems"] = problems(report)
    table = markdown(report)
    machine = report["machine"]
    write_result(args.out, "http_load_cpu", report,
        f"# HTTP (OpenAI-compatible) against gRPC, same mesh, CPU\n\n`{report['command']}` at commit "
        f"`{commit}`\n\n{machine['cpus']} CPUs, load average {machine['load_start']} at the start and "
        f"{machine['load_end']} at the end (the machine is shared).\n\n{table}\n\n"
        f"Loaded: gRPC and HTTP clients at the same time, {args.concurrency} streams each, sharing the "
        f"mesh's steps; paired: one request at a time, each prompt through gRPC then HTTP, the per-request "
        f"difference of E2E latency (the HTTP layer's added latency: JSON, SSE, uvicorn, FastAPI). Every "
        f"request is greedy, {args.max_new_tokens} tokens, checked against the gRPC reference tokens.\n\n"
        f"Verdict: {'PASS' if not report['problems'] else 'FAIL: ' + '; '.join(report['problems'])}\n")
    print(table)
    print(f"\nwrote {args.out / 'http_load_cpu.json'} and {args.out / 'http_load_cpu.md'}")
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
