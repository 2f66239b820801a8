"""Moves a training run off the GPU machine and into the repository.

The lent machine returns at most 8 files of at most 16 MB each, so `pack`
writes the checkpoint's safetensors shards as they are (each under 16 MB,
see export.MAX_SHARD_BYTES) and everything else of the run in one
`run.tar.gz`. `unpack` puts the checkpoint into services/model/demo/ and the
run's records (loss.csv, expert_hits.json, run.json) into tools/demo_model/:

    python -m tools.demo_model.pack unpack FILES_DIR [--model-dir services/model/demo]
"""

import argparse
import json
import pathlib
import shutil
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_FILES = ("loss.csv", "expert_hits.json", "run.json")
MAX_FILES, MAX_FILE_BYTES = 8, 16_000_000
TAR_NAME = "run.tar.gz"


def pack(run_dir: pathlib.Path, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the run as shards plus one tar into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "checkpoint"
    shards = sorted(ckpt.glob("*.safetensors"))
    written = [pathlib.Path(shutil.copyfile(s, out_dir / s.name)) for s in shards]
    with tarfile.open(out_dir / TAR_NAME, "w:gz") as tar:
        for path in sorted(ckpt.iterdir()):
            if path.suffix != ".safetensors":
                tar.add(path, arcname=f"checkpoint/{path.name}")
        for name in RUN_FILES:
            if (run_dir / name).is_file():  # a run that failed after saving still brings its weights back
                tar.add(run_dir / name, arcname=name)
    written.append(out_dir / TAR_NAME)
    too_big = [f"{p.name} ({p.stat().st_size} B)" for p in written if p.stat().st_size > MAX_FILE_BYTES]
    if len(written) > MAX_FILES or too_big:
        raise ValueError(f"packed {len(written)} files, too big: {too_big}; the limit is "
                         f"{MAX_FILES} files of {MAX_FILE_BYTES} B")
    return written


def unpack(files_dir: pathlib.Path, model_dir: pathlib.Path, records_dir: pathlib.Path) -> None:
    """Installs a packed run: the checkpoint into model_dir, the records into records_dir."""
    model_dir.mkdir(parents=True, exist_ok=True)
    records_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*model_dir.glob("*.safetensors"), *model_dir.glob("*.json"), *model_dir.glob("*.md")]:
        stale.unlink()
    for shard in sorted(files_dir.glob("*.safetensors")):
        shutil.copyfile(shard, model_dir / shard.name)
    with tarfile.open(files_dir / TAR_NAME, "r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name.removeprefix("checkpoint/"):
                raise ValueError(f"unexpected entry {member.name!r} in {TAR_NAME}")
            data = tar.extractfile(member).read()
            dest = model_dir if member.name.startswith("checkpoint/") else records_dir
            (dest / pathlib.Path(member.name).name).write_bytes(data)
    if (records_dir / "run.json").is_file():
        _decode_samples(records_dir / "run.json", model_dir / "tokenizer.json")


def _decode_samples(run_json: pathlib.Path, tokenizer_json: pathlib.Path) -> None:
    """Fills in the samples' text where the GPU machine could not decode it."""
    import tokenizers

    run = json.loads(run_json.read_text())
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    for sample in run["samples"]:
        sample.setdefault("completion", tok.decode(sample["new_token_ids"], skip_special_tokens=False))
    run_json.write_text(json.dumps(run, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="RUN_DIR -> OUT_DIR (on the GPU machine; train.py --pack-to does it)")
    p.add_argument("run_dir", type=pathlib.Path)
    p.add_argument("out_dir", type=pathlib.Path)
    u = sub.add_parser("unpack", help="FILES_DIR -> the checkpoint and the run records in the repo")
    u.add_argument("files_dir", type=pathlib.Path)
    u.add_argument("--model-dir", type=pathlib.Path, default=ROOT / "services" / "model" / "demo")
    u.add_argument("--records-dir", type=pathlib.Path, default=ROOT / "tools" / "demo_model")
    args = parser.parse_args(argv)
    if args.command == "pack":
        for path in pack(args.run_dir, args.out_dir):
            print(f"{path} {path.stat().st_size:,} B")
    else:
        unpack(args.files_dir, args.model_dir, args.records_dir)
        print(f"installed the checkpoint in {args.model_dir} and the run records in {args.records_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
