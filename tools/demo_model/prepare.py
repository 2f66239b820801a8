"""The CPU half of training: the demo model's tokenizer and the corpus as token ids.

    python -m tools.demo_model.prepare --corpus .demo_corpus [--vocab-size 8192]

Trains a byte-level BPE on the corpus shards (`CORPUS/text/corpus-*.jsonl.gz`)
with the `tokenizers` library: Qwen's pre-tokenizer regex and NFC, as the Qwen3
vocabulary has, and the special tokens <|endoftext|> (id 0), <|im_start|> (1)
and <|im_end|> (2). Then encodes every record, ChatML markers as their special
ids, each followed by <|endoftext|>, and writes `CORPUS/prepared/`:
`tokenizer.json`, `train.u16.gz` and `val.u16.gz` (little-endian uint16 ids;
one record in a hundred, by hash, is validation), `prompts.json` (the fixed
prompt set, encoded) and `meta.json`. The GPU
machine then needs neither `tokenizers` nor the text.
"""

import argparse
import array
import gzip
import hashlib
import json
import pathlib
import sys

import tokenizers
from tokenizers import AddedToken, models, pre_tokenizers, trainers

from tools.demo_model.data import META_FILE, PREPARED, PROMPTS_FILE, TRAIN_FILE, VAL_FILE
from tools.demo_model.fetch_corpus import read_records
from tools.demo_model.prompts import all_prompts
from services.tokenizer import END_OF_TEXT, IM_END, IM_START, set_qwen_pipeline

SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE of vocab_size ids (specials first) trained on texts."""
    tok = tokenizers.Tokenizer(models.BPE())
    set_qwen_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The markers are not text to learn merges from.
    plain = (text.replace(IM_START, "\n").replace(IM_END, "\n") for text in texts)
    tok.train_from_iterator(plain, trainer=trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, token
    return tok


def is_validation(text: str) -> bool:
    """One record in a hundred, chosen by its content so that the split is stable."""
    return hashlib.blake2b(text.encode(), digest_size=8).digest()[0] % 100 == 0


def encode_records(tok: tokenizers.Tokenizer, texts: list[str]) -> array.array:
    """The records' ids, each record followed by <|endoftext|>, as one uint16 stream."""
    eot = tok.token_to_id(END_OF_TEXT)
    out = array.array("H")
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(encoding.ids)
        out.append(eot)
    return out


def prepare(corpus_dir: pathlib.Path, vocab_size: int, max_records: int | None = None) -> pathlib.Path:
    """Writes CORPUS/prepared (see the module docstring); returns its path."""
    records = read_records(corpus_dir / "text")[:max_records]
    if not records:
        raise ValueError(f"no corpus records under {str(corpus_dir / 'text')!r}: run fetch_corpus first")
    if vocab_size >= 2 ** 16:
        raise ValueError(f"vocab_size {vocab_size} does not fit the uint16 token files")
    texts = [r["text"] for r in records]
    tok = train_tokenizer(texts, vocab_size)
    out = corpus_dir / PREPARED
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    val = [is_validation(t) for t in texts]
    if not any(val):
        val[-1] = True  # a tiny corpus still gets a validation record
    splits = {name: encode_records(tok, [t for t, v in zip(texts, val) if v == is_val])
              for name, is_val in ((TRAIN_FILE, False), (VAL_FILE, True))}
    for name, ids in splits.items():
        assert sys.byteorder == "little"
        (out / name).write_bytes(gzip.compress(ids.tobytes(), compresslevel=6, mtime=0))
    prompts = [{**p, "token_ids": tok.encode(p["model_text"], add_special_tokens=False).ids} for p in all_prompts()]
    (out / PROMPTS_FILE).write_text(json.dumps(prompts, indent=1) + "\n")
    meta = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "special_token_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "num_records": len(records),
        "num_chars": sum(map(len, texts)),
        "num_train_tokens": len(splits[TRAIN_FILE]),
        "num_val_tokens": len(splits[VAL_FILE]),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=pathlib.Path, default=pathlib.Path(".demo_corpus"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    out = prepare(args.corpus, args.vocab_size)
    meta = json.loads((out / META_FILE).read_text())
    print(f"{out}: vocab {meta['vocab_size']}, {meta['num_train_tokens']:,} train and "
          f"{meta['num_val_tokens']:,} validation tokens from {meta['num_chars'] / 1e6:.1f} MB of text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
