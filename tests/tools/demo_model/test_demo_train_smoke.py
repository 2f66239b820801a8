"""The demo model's pipeline end to end on a tiny corpus: prepare, train, pack, unpack, verify.

The corpus is this repository's own docs plus a few chat pairs, so no package
is downloaded; the model is the --tiny shape, trained for a few steps on the CPU.
"""

import csv
import json
import pathlib
import random

import pytest

from tools.demo_model import fetch_corpus, pack, prepare, train, verify
from tools.demo_model.prompts import all_prompts
from services.model.checkpoint import load_weights
from services.model.config import ModelConfig
from services.tokenizer import Tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[3]
NUM_STEPS = 24


def _tiny_corpus(corpus_dir: pathlib.Path) -> None:
    """Text records from the repo's markdown, and chat records from made-up pairs."""
    paragraphs = [p.strip() for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
                  for p in path.read_text().split("\n\n") if len(p.strip()) > 40]
    records = [{"source": "repo-docs", "kind": "text", "text": p} for p in paragraphs]
    words = ["mesh", "expert", "router", "gateway", "token", "layer", "cache", "rank"]
    pairs = [(f'What does "{words[i % len(words)]}" mean?', f"It is part {i} of moemesh.") for i in range(40)]
    records += [{"source": "made-up", "kind": "chat", "text": t}
                for t in fetch_corpus.conversations(pairs, random.Random(0))]
    fetch_corpus.write_shards(records, corpus_dir / "text", shard_bytes=20_000)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    base = tmp_path_factory.mktemp("demo")
    _tiny_corpus(base / "corpus")
    prepare.prepare(base / "corpus", vocab_size=512)
    args = ["--corpus", str(base / "corpus"), "--out", str(base / "run"), "--tiny", "--minutes", "0.5",
            "--steps", str(NUM_STEPS), "--pack-to", str(base / "packed")]
    assert train.main(args) == 0
    return base / "run"


def test_checkpoint_loads_in_moemesh_with_its_own_tokenizer(run_dir):
    ckpt = run_dir / "checkpoint"
    config = ModelConfig.from_model_dir(ckpt)
    assert (config.vocab_size, config.tie_word_embeddings, config.eos_token_ids) == (512, True, (2, 0))
    weights = load_weights(ckpt, config, range(config.num_experts))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in weights
    tok = Tokenizer.from_model_dir(ckpt)
    assert tok.vocab_size == 512 and tok.eos_token_ids == (2, 0)
    assert tok.decode(tok.encode("The mesh routes tokens.")) == "The mesh routes tokens."
    assert tok.encode("<|im_end|>") != [2]  # a marker in user text stays text


def test_moemesh_and_transformers_match_the_training_model(run_dir):
    recorded = json.loads((run_dir / "expert_hits.json").read_text())
    verify.check_tokenizer(run_dir / "checkpoint", recorded["prompts"])
    hits = verify.check_logits(run_dir / "checkpoint", recorded["prompts"])
    verify.check_hits(recorded, hits, run_dir / "checkpoint")
    assert sum(map(sum, hits["hits_LE"])) == recorded["num_tokens"] * recorded["top_k"] * 2  # 2 layers


def test_loss_log_and_run_record(run_dir):
    rows = list(csv.DictReader((run_dir / "loss.csv").open()))
    assert [int(r["step"]) for r in rows] == [10, 20, NUM_STEPS]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert rows[-1]["val_loss"] != ""
    run = json.loads((run_dir / "run.json").read_text())
    assert run["steps"] == NUM_STEPS and len(run["samples"]) == len(all_prompts())
    assert all("completion" in s for s in run["samples"])


def test_pack_fits_the_device_limits_and_unpacks_to_the_same_files(run_dir, tmp_path):
    packed = run_dir.parent / "packed"
    files = sorted(p.name for p in packed.iterdir())
    assert files == ["model.safetensors", "run.tar.gz"]
    pack.unpack(packed, tmp_path / "model", tmp_path / "records")
    for path in (run_dir / "checkpoint").iterdir():
        assert (tmp_path / "model" / path.name).read_bytes() == path.read_bytes(), path.name
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == sorted(pack.RUN_FILES)


def test_moemesh_up_serves_the_demo_model_once_installed(run_dir, tmp_path):
    from moemesh import cli

    pack.unpack(run_dir.parent / "packed", tmp_path / "demo", tmp_path / "records")
    assert cli.default_model_dir(tmp_path / "demo") == str(tmp_path / "demo")


INSTALLED = ROOT / "services" / "model" / "demo"


@pytest.mark.skipif(not (INSTALLED / "config.json").is_file(), reason="the demo checkpoint is not installed yet")
def test_installed_demo_model_matches_transformers_and_its_record():
    recorded = json.loads((ROOT / "tools" / "demo_model" / "expert_hits.json").read_text())
    verify.check_tokenizer(INSTALLED, recorded["prompts"])
    hits = verify.check_logits(INSTALLED, recorded["prompts"])
    recount = verify.check_hits(recorded, hits, INSTALLED)
    assert recount == recorded, "run `python -m tools.demo_model.verify ... --rewrite-hits`"
