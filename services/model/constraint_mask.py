"""Applying constrained sequences' token bitmasks (services/constraints.py) to a step's logits.

A bitmask row holds one bit per token of the vocabulary in int32 words (bit i of word w is
token 32 w + i; 1 allows it). The rows of the constrained sequences are unpacked on the
logits' device and the tokens they forbid set to -inf before sampling, so greedy picks and
draws alike stay inside the constraint; the other rows are not read or written, so an
unconstrained sequence's logits are the same bits with or without constrained neighbours.
Legend: S sequences (logit rows), C constrained rows, W int32 words per row, V vocab.
"""

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from services.model.batch import to_device

_BITS_32 = {}   # device -> int32 [32]: 0..31, the shift of each bit in a word


def apply_token_bitmask_(logits_SV: Tensor, bitmask_CW: np.ndarray | Tensor, rows: Sequence[int]) -> Tensor:
    """Set to -inf, in place, the logits that bitmask row c forbids in logit row rows[c]; returns logits_SV.

    `bitmask_CW` is int32 (numpy or a tensor on any device) with W = ceil(V / 32): a
    services.constraints.Compiler built with the model's vocab_size. An empty `rows` changes
    nothing and launches nothing.
    """
    if len(rows) != bitmask_CW.shape[0]:
        raise ValueError(f"{len(rows)} rows for {bitmask_CW.shape[0]} bitmask rows")
    if not len(rows):
        return logits_SV
    vocab, device = logits_SV.shape[1], logits_SV.device
    if isinstance(bitmask_CW, np.ndarray):
        bitmask_CW = torch.from_numpy(bitmask_CW)
    if bitmask_CW.dtype != torch.int32 or bitmask_CW.shape[1] != (vocab + 31) // 32:
        raise ValueError(f"bitmask must be int32 with ceil({vocab} / 32) words a row, "
                         f"got {bitmask_CW.dtype} {tuple(bitmask_CW.shape)}")
    if bitmask_CW.device != device:
        bitmask_CW = to_device(bitmask_CW, device)
    if device not in _BITS_32:
        _BITS_32[device] = torch.arange(32, dtype=torch.int32, device=device)
    allowed_CV = ((bitmask_CW[:, :, None] >> _BITS_32[device]) & 1).bool().flatten(1)[:, :vocab]
    rows_C = to_device(torch.tensor(list(rows), dtype=torch.int64), device)
    logits_CV = logits_SV.index_select(0, rows_C).masked_fill_(~allowed_CV, float("-inf"))
    return logits_SV.index_copy_(0, rows_C, logits_CV)
