"""Builds the demo model's training corpus from Debian packages, offline from here on.

    python -m tools.demo_model.fetch_corpus [--out .demo_corpus]

Downloads each package of SOURCES with `apt-get download` (run `apt-get update`
once first), unpacks it with `dpkg-deb -x`, extracts plain English (see
extract.py), drops repeated paragraphs and pairs, renders the question/answer
pairs as ChatML conversations, and writes shuffled gzip JSONL shards
(`OUT/text/corpus-NNN.jsonl.gz`, one {"source", "kind", "text"} per line),
`OUT/text/manifest.json` and `tools/demo_model/SOURCES.md`. Each licence was
read from the package's copyright file; the run records the package versions.
"""

import argparse
import dataclasses
import gzip
import hashlib
import json
import pathlib
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

from tools.demo_model import extract, sources_doc
from services.tokenizer import IM_END, IM_START

HERE = pathlib.Path(__file__).resolve().parent
# Fortune files kept. Left out: offensive or political ones (ethnic, men-women,
# drugs, politics), quotations of recent copyrighted works (pratchett, startrek,
# zippy, songs-poems), and non-prose or in-jokes (ascii-art, debian, linuxcookie,
# perl, knghtbrd, translate-me, disclaimer).
FORTUNE_FILES = (
    "art", "computers", "cookie", "definitions", "education", "food", "goedel", "humorists", "kids",
    "law", "linux", "love", "magic", "medicine", "miscellaneous", "news", "paradoxum", "people", "pets",
    "platitudes", "science", "sports", "tao", "wisdom", "work",
)
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclasses.dataclass(frozen=True)
class Source:
    """One Debian package of the corpus."""

    package: str
    licence: str  # as its copyright file states it
    content: str  # what is taken from it
    extract: Callable[[pathlib.Path], extract.Extracted]
    chat_fraction: float = 1.0  # share of its question/answer pairs kept


SOURCES = (
    Source("python3.11-doc", "PSF-2.0 (Python Software Foundation License)",
           "the Python 3.11 documentation (HTML, code blocks dropped)", extract.html_docs),
    Source("python-django-doc", "BSD-3-Clause", "the Django 3.2 documentation, release notes dropped",
           lambda root: extract.html_docs(root, re.compile(r"(^|/)releases/"))),
    Source("sqlite3-doc", "public domain", "the SQLite documentation, change logs dropped",
           lambda root: extract.html_docs(root, re.compile(r"(^|/)(releaselog/|changes\.html$)"))),
    Source("postgresql-doc-15", "PostgreSQL License (BSD-style)",
           "the PostgreSQL 15 documentation, release notes dropped",
           lambda root: extract.html_docs(root, re.compile(r"(^|/)release-[^/]*\.html$"))),
    Source("wordnet-base", "WordNet 3.0 License (permissive; notice below)",
           "WordNet 3.0 glosses, as questions about word meanings", extract.wordnet, chat_fraction=0.35),
    Source("jargon-text", "public domain", "the Jargon File 4.4.7", extract.jargon_file),
    Source("dict-devil", "public domain (1911, copyright expired)", "The Devil's Dictionary by Ambrose Bierce",
           extract.devils_dictionary),
    Source("fortunes-min", "BSD-3-Clause (fortune-mod; quotations from many authors)",
           "fortune cookies: fortunes, literature, riddles",
           lambda root: extract.fortunes(root, ("fortunes", "literature", "riddles")), chat_fraction=0.5),
    Source("fortunes", "BSD-3-Clause (fortune-mod; quotations from many authors)",
           f"fortune cookies: {', '.join(FORTUNE_FILES)}",
           lambda root: extract.fortunes(root, FORTUNE_FILES), chat_fraction=0.5),
)


def fetch_package(package: str, debs_dir: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The package's .deb (downloaded unless cached in debs_dir) and its version."""
    debs_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(debs_dir.glob(f"{package}_*.deb"))
    if len(found) != 1:
        for stale in found:
            stale.unlink()
        done = subprocess.run(["apt-get", "download", package], cwd=debs_dir, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"apt-get download {package} failed (run `apt-get update` first?): "
                               f"{done.stderr.strip()}")
        found = sorted(debs_dir.glob(f"{package}_*.deb"))
    deb = found[0]
    version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True,
                             text=True).stdout.strip()
    return deb, version


def unpack(deb: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """Unpacks the .deb's files under root (once)."""
    if not root.is_dir():
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(partial)], check=True)
        partial.rename(root)
    return root


def render_chat(messages: list[tuple[str, str]]) -> str:
    """ChatML text of a whole conversation; the same as services.tokenizer's template."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


class Deduper:
    """Remembers paragraphs and pairs already taken, across all sources."""

    def __init__(self, min_chars: int = 60):
        self.min_chars, self._seen = min_chars, set()

    def _is_new(self, text: str) -> bool:
        key = hashlib.blake2b(" ".join(text.lower().split()).encode(), digest_size=16).digest()
        is_new = key not in self._seen
        self._seen.add(key)
        return is_new

    def document(self, doc: str) -> str:
        """The document without paragraphs seen before (short ones, headings, are kept)."""
        paragraphs = doc.split("\n\n")
        return "\n\n".join(p for p in paragraphs if len(p) < self.min_chars or self._is_new(p))

    def pair(self, question: str, answer: str) -> bool:
        return self._is_new(question + "\x00" + answer)


def conversations(pairs: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """Pairs grouped into ChatML conversations of 1 to 3 turns, some with a system prompt."""
    out, i = [], 0
    while i < len(pairs):
        turns = rng.choice((1, 1, 2, 3))
        messages = [("system", SYSTEM_PROMPT)] if rng.random() < 0.1 else []
        for question, answer in pairs[i:i + turns]:
            messages += [("user", question), ("assistant", answer)]
        out.append(render_chat(messages))
        i += turns
    return out


def build_records(source: Source, found: extract.Extracted, dedup: Deduper, rng: random.Random) -> list[dict]:
    """The source's documents and conversations as corpus records."""
    records = []
    for doc in found.documents:
        doc = dedup.document(doc)
        if len(doc) >= 20:
            records.append({"source": source.package, "kind": "text", "text": doc})
    pairs = [pair for pair in found.qa_pairs if dedup.pair(*pair)]
    rng.shuffle(pairs)
    pairs = pairs[:round(len(pairs) * source.chat_fraction)]
    records += [{"source": source.package, "kind": "chat", "text": text} for text in conversations(pairs, rng)]
    return records


def write_shards(records: list[dict], out_dir: pathlib.Path, shard_bytes: int) -> list[dict]:
    """Gzip JSONL shards of about shard_bytes of JSON each; returns their name, size and sha256."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("corpus-*.jsonl.gz"):
        stale.unlink()
    shards, lines, size = [], [], 0
    for i, record in enumerate(records):
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        size += len(lines[-1])
        if size >= shard_bytes or i == len(records) - 1:
            path = out_dir / f"corpus-{len(shards):03d}.jsonl.gz"
            data = gzip.compress("".join(lines).encode(), compresslevel=9, mtime=0)
            path.write_bytes(data)
            shards.append({"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            lines, size = [], 0
    return shards


def read_records(text_dir: pathlib.Path) -> list[dict]:
    """All records of the shards in text_dir, in shard order."""
    records = []
    for path in sorted(text_dir.glob("corpus-*.jsonl.gz")):
        records += [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    return records


def _sizes(records: list[dict]) -> dict[str, int]:
    """Number of records and characters of each kind."""
    sizes = {}
    for kind in ("text", "chat"):
        texts = [r["text"] for r in records if r["kind"] == kind]
        sizes[f"{kind}_records"], sizes[f"{kind}_chars"] = len(texts), sum(map(len, texts))
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".demo_corpus"))
    parser.add_argument("--shard-mb", type=float, default=12.0, help="uncompressed MB per shard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sources-md", type=pathlib.Path, default=HERE / "SOURCES.md")
    args = parser.parse_args(argv)
    rng, dedup, records, stats = random.Random(args.seed), Deduper(), [], []
    for source in SOURCES:
        deb, version = fetch_package(source.package, args.out / "debs")
        found = source.extract(unpack(deb, args.out / "debs" / "x" / source.package))
        new = build_records(source, found, dedup, rng)
        stats.append({"package": source.package, "version": version, "licence": source.licence,
                      "content": source.content, "deb_bytes": deb.stat().st_size, **_sizes(new)})
        print(f"{source.package} {version}: {stats[-1]['text_chars'] / 1e6:.2f} MB text, "
              f"{stats[-1]['chat_chars'] / 1e6:.2f} MB chat", flush=True)
        records += new
    rng.shuffle(records)
    shards = write_shards(records, args.out / "text", int(args.shard_mb * 1e6))
    manifest = {"seed": args.seed, "sources": stats, "shards": shards}
    (args.out / "text" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    args.sources_md.write_text(sources_doc.render(manifest))
    total = sum(s["text_chars"] + s["chat_chars"] for s in stats)
    print(f"{len(records)} records, {total / 1e6:.1f} MB of text, "
          f"{sum(s['bytes'] for s in shards) / 1e6:.1f} MB in {len(shards)} gzip shard(s) under {args.out / 'text'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
