"""The prepared token streams (see prepare.py) and random training windows over them.

Needs only torch: this is what runs on the GPU machine.
"""

import gzip
import json
import pathlib

import torch

PREPARED = "prepared"
TRAIN_FILE, VAL_FILE, META_FILE = "train.u16.gz", "val.u16.gz", "meta.json"
PROMPTS_FILE = "prompts.json"


def _u16_tensor(path: pathlib.Path, device) -> torch.Tensor:
    """A gzip file of little-endian uint16 ids as an int64 tensor."""
    raw = bytearray(gzip.decompress(path.read_bytes()))
    # int16 then masked: uint16 tensors support few ops in older torch.
    return (torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) & 0xFFFF).to(device)


def load_prepared(prepared_dir: pathlib.Path, device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """meta.json, and the train and validation streams as int64 tensors on device."""
    meta = json.loads((prepared_dir / META_FILE).read_text())
    return meta, _u16_tensor(prepared_dir / TRAIN_FILE, device), _u16_tensor(prepared_dir / VAL_FILE, device)


def sample_windows(tokens_N: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size random windows: inputs [B, T] and next-token targets [B, T]."""
    if tokens_N.numel() <= seq_len + 1:
        raise ValueError(f"a stream of {tokens_N.numel()} tokens is too short for windows of {seq_len}")
    starts_B = torch.randint(0, tokens_N.numel() - seq_len - 1, (batch_size,),
                             generator=generator, device=tokens_N.device)
    window_BT = tokens_N[starts_B[:, None] + torch.arange(seq_len + 1, device=tokens_N.device)]
    return window_BT[:, :-1], window_BT[:, 1:]


def fixed_windows(tokens_N: torch.Tensor, num_windows: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced windows (the same every call): the validation set, one window per batch row.

    A stream shorter than one window (a small smoke-test corpus) gives one shorter window.
    """
    if tokens_N.numel() < 2:
        raise ValueError(f"a validation stream of {tokens_N.numel()} tokens is too short")
    seq_len = min(seq_len, tokens_N.numel() - 1)
    num_windows = max(1, min(num_windows, (tokens_N.numel() - 1) // seq_len))
    starts = torch.linspace(0, tokens_N.numel() - seq_len - 1, num_windows).long().tolist()
    return [(tokens_N[s:s + seq_len], tokens_N[s + 1:s + seq_len + 1]) for s in starts]
