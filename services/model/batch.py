"""One forward step's inputs: the sequences of a step flattened into a varlen batch.

A batch mixes prefill chunks and decode tokens of several sequences. Tokens of
all sequences are concatenated along T; sequence i owns rows
`[cu_q_lens[i], cu_q_lens[i + 1])`. Legend: T tokens of the step, B sequences,
S rows whose logits are returned, M blocks of the longest block table.
"""

import dataclasses
import itertools

import torch
from torch import Tensor


@dataclasses.dataclass(slots=True)
class SeqInput:
    """One sequence's share of a step."""

    seq_id: int
    # The new input tokens of this step (at least one).
    token_ids: list[int]
    # Tokens already in the KV cache: this step's positions start here.
    num_computed: int
    # KV block ids covering num_computed + len(token_ids) tokens.
    block_table: list[int]
    # Return logits for the last new token.
    is_sampled: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The tensors of one step; host-side lengths for the per-sequence loops."""

    input_ids_T: Tensor  # int64
    positions_T: Tensor  # int64, position of each token within its sequence
    slot_mapping_T: Tensor  # int64, KV slot (block * block_size + offset) each token writes
    q_lens: tuple[int, ...]  # new tokens per sequence (B)
    context_lens: tuple[int, ...]  # num_computed + new tokens per sequence (B)
    block_tables_BM: Tensor  # int32, padded with 0 past each sequence's table
    # Rows of T whose logits forward returns: the last token of each sampled
    # sequence. Any rows may be listed (e.g. all of them to score a prompt).
    sample_indices_S: Tensor  # int64

    @property
    def num_tokens(self) -> int:
        """T: the number of new tokens in the step."""
        return self.input_ids_T.shape[0]

    @property
    def cu_q_lens(self) -> list[int]:
        """Start row of each sequence's tokens, then T (B + 1 entries)."""
        return [0, *itertools.accumulate(self.q_lens)]


def build_forward_batch(seqs: list[SeqInput], block_size: int, device) -> ForwardBatch:
    """Flattens the step's sequences into one batch on `device`.

    An empty list gives an empty batch (an idle step still runs the model so
    the expert collectives of every rank line up).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    input_ids, positions, slots, sample_indices = [], [], [], []
    for seq in seqs:
        _check_seq(seq, block_size)
        for pos in range(seq.num_computed, seq.num_computed + len(seq.token_ids)):
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        input_ids.extend(seq.token_ids)
        if seq.is_sampled:
            sample_indices.append(len(input_ids) - 1)
    max_blocks = max((len(s.block_table) for s in seqs), default=0)
    block_tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]

    def int64(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        input_ids_T=int64(input_ids),
        positions_T=int64(positions),
        slot_mapping_T=int64(slots),
        q_lens=tuple(len(s.token_ids) for s in seqs),
        context_lens=tuple(s.num_computed + len(s.token_ids) for s in seqs),
        block_tables_BM=torch.tensor(block_tables, dtype=torch.int32, device=device).view(len(seqs), max_blocks),
        sample_indices_S=int64(sample_indices),
    )


def _check_seq(seq: SeqInput, block_size: int) -> None:
    if not seq.token_ids:
        raise ValueError(f"sequence {seq.seq_id} has no new tokens")
    if seq.num_computed < 0:
        raise ValueError(f"sequence {seq.seq_id} has num_computed {seq.num_computed} < 0")
    needed = -(-(seq.num_computed + len(seq.token_ids)) // block_size)
    if len(seq.block_table) < needed:
        raise ValueError(
            f"sequence {seq.seq_id} has {len(seq.block_table)} blocks, needs {needed} "
            f"for {seq.num_computed + len(seq.token_ids)} tokens"
        )
