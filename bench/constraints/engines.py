"""xgrammar against llguidance on the Qwen3 tokenizer: build, compile, mask, memory, keywords (issue 26).

    python -m bench.constraints.engines [--engines xgrammar,llguidance] [--repeats 5] [--out bench/results]

Each engine runs in its own subprocess (so that one's imports and caches do not count in the
other's RSS), on the full Qwen3 vocabulary (services.tokenizer, 151,669 tokens, masks 151,936
wide: the model's logits), for four constraints: the ticket-classifier JSON Schema of issue 26,
a regex, a choice and any JSON object. Per engine and constraint: the tokenizer-info build,
a cold compile (a new compiler, up to the first mask), a cached one (the engine's own cache, or
a copy of a compiled matcher, up to the first mask), and the per-token cost over a whole valid
answer (fill the next-token bitmask, then accept the answer's token; EOS last), and one step
of a batch of ticket-schema sequences (the engine's parallel fill, then the accepts). RSS growth
after the tokenizer build and after the compiles. Then which JSON Schema keywords each engine
enforces: a probe schema must accept a valid text and reject the invalid ones.
JSON is compiled without free whitespace in both (", " and ": " separators).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 151_936   # Qwen3-MoE's logits width (the tokenizer has 151,669 tokens)
SEPARATORS = (", ", ": ")
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "is_dispute": {"type": "boolean"},
        "amount": {"type": "number"},
        "date_range": {"type": "array", "items": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                       "minItems": 2, "maxItems": 2},
        "order_id": {"type": "string", "pattern": r"^ORD-[0-9]{6}$"},
    },
    "required": ["is_dispute", "amount", "date_range", "order_id"],
    "additionalProperties": False,
}
CHOICES = ("refund", "replacement", "escalate to a human", "no action")
# (name, kind, constraint text, a valid answer)
CASES = (
    ("ticket schema", "json_schema", json.dumps(TICKET_SCHEMA),
     '{"is_dispute": true, "amount": 129.99, "date_range": ["2026-01-02", "2026-01-31"], '
     '"order_id": "ORD-123456"}'),
    ("regex", "regex", r"[A-Z]{3}-\d{4}( [a-z]+){1,5}\.", "ABC-2026 the order never came."),
    ("choice", "regex", "|".join(CHOICES), "escalate to a human"),
    ("json_object", "json_schema", '{"type": "object"}',
     '{"customer": "Ana Lima", "message": "My parcel arrived damaged and I would like a refund, '
     'or a replacement if that is quicker.", "items": [{"sku": "A-17", "qty": 2}, {"sku": "B-3", '
     '"qty": 1}], "priority": 2, "vip": false}'),
)
# keyword -> (schema, valid text, invalid texts)
PROBES = {
    "type/properties/required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 '{"a": 1}', ['{}', '{"a": "x"}']),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": False}, '{"a": 1}', ['{"a": 1, "b": 2}']),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1, 2]", ['["x"]']),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
                          "[1, 2]", ["[1]", "[1, 2, 3, 4]"]),
    "enum": ({"enum": ["a", "b", 3]}, '"b"', ['"c"', "4"]),
    "const": ({"const": "x"}, '"x"', ['"y"']),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", ['"s"']),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", ['"s"']),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "3", ["1"]),
    "pattern": ({"type": "string", "pattern": "^a+b$"}, '"aab"', ['"ba"']),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', ['"a"', '"abcd"']),
    "$defs/$ref": ({"$defs": {"x": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                    "required": ["a"]}, '{"a": 3}', ['{"a": "s"}']),
    "recursive $ref": ({"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}},
                       "$ref": "#/$defs/n"}, '{"k": {"k": {}}}', ['{"k": 1}']),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 5}, "3", ["7", "0"]),
    "format: date": ({"type": "string", "format": "date"}, '"2026-12-03"', ['"yesterday"']),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    '[1, "a"]', ['["a", 1]']),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", ["[1, 1]"]),
    "not": ({"not": {"type": "integer"}}, '"s"', ["1"]),
}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class XGrammar:
    """xgrammar: TokenizerInfo + GrammarCompiler (its cache) + GrammarMatcher."""

    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar
        self.xgr = xgrammar
        vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                                           stop_token_ids=list(tok.eos_token_ids))
        self.compiler = self.new_compiler()

    def new_compiler(self):
        return self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)

    def compile(self, compiler, kind, text):
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_json_schema(text, any_whitespace=False, separators=SEPARATORS)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, VOCAB)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask)

    def batch_fill(self, matchers, bitmask):
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def batch_bitmask(self, size):
        return self.xgr.allocate_token_bitmask(size, VOCAB)

    def accept(self, matcher, token):
        return matcher.accept_token(token)

    def is_done(self, matcher):
        return matcher.is_terminated()


class LLGuidance:
    """llguidance: LLTokenizer + grammar text + LLMatcher (deep_copy of a compiled one as the cache)."""

    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import numpy as np
        from services.tokenizer import qwen3_tokenizer_path
        self.llg, self.np = llguidance, np
        self.tok = llguidance.LLTokenizer(qwen3_tokenizer_path().read_text(), n_vocab=VOCAB,
                                          eos_token=list(tok.eos_token_ids))
        self.compiler = None

    def new_compiler(self):
        return {}

    def compile(self, compiler, kind, text):
        if text in compiler:
            return compiler[text].deep_copy()
        if kind == "regex":
            grammar = self.llg.LLMatcher.grammar_from_regex(text)
        else:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(text, defaults={
                "whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]})
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        compiler[text] = matcher
        return matcher.deep_copy()

    def matcher(self, compiled):
        return compiled

    def bitmask(self):
        return self.np.zeros((1, (VOCAB + 31) // 32), dtype=self.np.int32)

    def fill(self, matcher, bitmask):
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def batch_fill(self, matchers, bitmask):
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor()
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def batch_bitmask(self, size):
        return self.np.zeros((size, (VOCAB + 31) // 32), dtype=self.np.int32)

    def accept(self, matcher, token):
        return matcher.consume_token(token)

    def is_done(self, matcher):
        return matcher.is_stopped() and not matcher.is_error()


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def _is_allowed(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def _walk(engine, matcher, token_ids, bitmask) -> list[float]:
    """Fill then accept each token; the seconds of each pair. Asserts the answer is allowed."""
    seconds = []
    for token in token_ids:
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        is_accepted = engine.accept(matcher, token)
        seconds.append(time.perf_counter() - start)
        assert is_accepted and _is_allowed(bitmask, token), (engine.name, token)
    assert engine.is_done(matcher), engine.name
    return seconds


def _accepts(engine, compiled, token_ids) -> bool:
    matcher = engine.matcher(compiled)
    return all(engine.accept(matcher, t) for t in token_ids) and engine.is_done(matcher)


def _probe(engine, tok, schema, valid, invalids) -> str:
    eos = tok.eos_token_ids[0]
    try:
        compiled = engine.compile(engine.new_compiler(), "json_schema", json.dumps(schema))
    except Exception as e:   # each engine raises its own types; the message is the result
        return "error: " + str(e).splitlines()[0][:70]
    if not _accepts(engine, compiled, tok.encode(valid) + [eos]):
        return "rejects valid"
    leaks = [text for text in invalids if _accepts(engine, compiled, tok.encode(text) + [eos])]
    return "enforced" if not leaks else "not enforced (accepts " + ", ".join(leaks) + ")"


def _batch_step(engine, tok, batch_size: int) -> dict:
    """`batch_size` ticket-schema sequences in lockstep over the valid answer: the engine's parallel
    fill of all their rows, then each accepts its token; the mean milliseconds of each part per step."""
    _, kind, text, answer = CASES[0]
    token_ids = tok.encode(answer) + [tok.eos_token_ids[0]]
    matchers = [engine.matcher(engine.compile(engine.compiler or engine.new_compiler(), kind, text))
                for _ in range(batch_size)]
    bitmask, fill_s, accept_s = engine.batch_bitmask(batch_size), 0.0, 0.0
    for token in token_ids:
        start = time.perf_counter()
        engine.batch_fill(matchers, bitmask)
        middle = time.perf_counter()
        assert all([engine.accept(m, token) for m in matchers])
        fill_s, accept_s = fill_s + middle - start, accept_s + time.perf_counter() - middle
    return {"batch_size": batch_size, "fill_ms": 1e3 * fill_s / len(token_ids),
            "accept_ms": 1e3 * accept_s / len(token_ids)}


def run_engine(name: str, repeats: int, batch_size: int) -> dict:
    """One engine's figures (run in its own process)."""
    from services.tokenizer import Tokenizer

    tok = Tokenizer.qwen3()
    rss_import, import_start, torch_before = _rss_mb(), time.perf_counter(), "torch" in sys.modules
    __import__(name)
    import_s = time.perf_counter() - import_start
    rss_start = _rss_mb()
    start = time.perf_counter()
    engine = ENGINES[name](tok)
    out = {"engine": name, "import_s": import_s, "imports_torch": not torch_before and "torch" in sys.modules,
           "import_rss_mb": rss_start - rss_import,
           "tokenizer_info_s": time.perf_counter() - start, "tokenizer_rss_mb": _rss_mb() - rss_start, "cases": {}}
    rss_compiled = _rss_mb()
    eos = tok.eos_token_ids[0]
    for case, kind, text, answer in CASES:
        bitmask = engine.bitmask()
        cold, cached = [], []
        for _ in range(repeats):
            compiler = engine.new_compiler()
            start = time.perf_counter()
            engine.fill(engine.matcher(engine.compile(compiler, kind, text)), bitmask)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.fill(engine.matcher(engine.compile(compiler, kind, text)), bitmask)
            cached.append(time.perf_counter() - start)
        token_ids = tok.encode(answer) + [eos]
        per_token = []
        for _ in range(repeats):
            per_token += _walk(engine, engine.matcher(engine.compile(engine.compiler or compiler, kind, text)),
                               token_ids, bitmask)
        per_token.sort()
        out["cases"][case] = {
            "cold_compile_ms": 1e3 * sorted(cold)[len(cold) // 2], "cached_compile_ms": 1e3 * sorted(cached)[len(cached) // 2],
            "num_tokens": len(token_ids), "mask_mean_us": 1e6 * sum(per_token) / len(per_token),
            "mask_p99_us": 1e6 * per_token[int(0.99 * (len(per_token) - 1))], "mask_max_us": 1e6 * per_token[-1]}
    out["compile_rss_mb"] = _rss_mb() - rss_compiled
    out["batch"] = _batch_step(engine, tok, batch_size)
    out["keywords"] = {keyword: _probe(engine, tok, *probe) for keyword, probe in PROBES.items()}
    return out


def _table(results: list[dict]) -> str:
    names = [r["engine"] for r in results]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("import (s); loads torch", [f"{r['import_s']:.2f}; {'yes' if r['imports_torch'] else 'no'}" for r in results])
    row("RSS growth: import (MB)", [f"{r['import_rss_mb']:.0f}" for r in results])
    row("tokenizer info build (s)", [f"{r['tokenizer_info_s']:.2f}" for r in results])
    row("RSS growth: tokenizer info (MB)", [f"{r['tokenizer_rss_mb']:.0f}" for r in results])
    row("RSS growth: compiles and walks (MB)", [f"{r['compile_rss_mb']:.0f}" for r in results])
    row(f"ticket schema, {results[0]['batch']['batch_size']} sequences in lockstep: parallel fill / accepts "
        "per step (ms)", [f"{r['batch']['fill_ms']:.2f} / {r['batch']['accept_ms']:.2f}" for r in results])
    for case, *_ in CASES:
        cells = [r["cases"][case] for r in results]
        row(f"{case}: cold compile to first mask (ms)", [f"{c['cold_compile_ms']:.2f}" for c in cells])
        row(f"{case}: cached compile to first mask (ms)", [f"{c['cached_compile_ms']:.3f}" for c in cells])
        row(f"{case}: fill+accept per token, mean / p99 / max (µs) over {cells[0]['num_tokens']} tokens",
            [f"{c['mask_mean_us']:.0f} / {c['mask_p99_us']:.0f} / {c['mask_max_us']:.0f}" for c in cells])
    lines += ["", "| JSON Schema keyword | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for keyword in PROBES:
        row(keyword, [r["keywords"][keyword] for r in results])
    return "\n".join(lines)


def jump_forward_steps() -> str:
    """Model steps per output token for the valid answers, with services.constraints' jump-forward:
    an oracle model writes the answer, and whenever the constraint forces tokens they are appended
    without a step (its output then is the same text)."""
    from services.constraints import Compiler
    from services.step import Constraint
    from services.tokenizer import Tokenizer

    tok = Tokenizer.qwen3()
    compiler = Compiler.for_tokenizer(tok, VOCAB)
    lines = ["| constraint | output tokens | model steps without jump-forward | with |", "|---|---|---|---|"]
    for case, kind, text, answer in CASES:
        constraint = Constraint("choice", CHOICES) if case == "choice" else (
            Constraint("json_object") if case == "json_object" else Constraint(kind, text))
        matcher, rest, tokens, steps = compiler.matcher(constraint), answer, [], 0
        while rest:
            forced = matcher.forced_token_ids()
            if not forced:               # the model's step: the next token of the rest's encoding
                forced, steps = tok.encode(rest)[:1], steps + 1
            for token in forced:
                assert matcher.accept(token), (case, rest)
            tokens += forced
            assert rest.startswith(tok.decode(forced)), (case, rest, forced)
            rest = rest[len(tok.decode(forced)):]
        assert tok.decode(tokens) == answer
        lines.append(f"| {case} | {len(tokens) + 1} | {len(tok.encode(answer)) + 1} | {steps + 1} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="xgrammar,llguidance")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="constrained sequences of one step")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_engine(args.worker, args.repeats, args.batch_size)))
        return 0
    results = []
    for name in args.engines.split(","):
        done = subprocess.run([sys.executable, "-m", "bench.constraints.engines", "--worker", name,
                               "--repeats", str(args.repeats), "--batch-size", str(args.batch_size)], check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = _table(results) + "\n\nJump-forward (llguidance's forced tokens, the EOS counted):\n\n" + jump_forward_steps()
    print(table)
    if args.out:
        command = "python -m bench.constraints.engines " + " ".join(argv if argv is not None else sys.argv[1:])
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.mkdir(parents=True, exist_ok=True)
        header = (f"# Grammar engines on the Qwen3 tokenizer (CPU)\n\n> `{command}` at commit `{commit}`, "
                  f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs (shared).\n\n")
        (args.out / "constraint_engines_cpu.md").write_text(header + table + "\n")
        (args.out / "constraint_engines_cpu.json").write_text(
            json.dumps({"command": command, "commit": commit, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
