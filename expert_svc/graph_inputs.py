"""A CUDA graph's per-row inputs on the device, filled by one copy per step (graph_runner.py).

Legend: R rows of the largest bucket, B rows of a step's bucket, M block-table
columns, C the columns a step's tables use.
"""

import array
import itertools
from collections.abc import Sequence

import torch

from services.model.batch import SeqInput, check_decode_seqs


class StaticInputs:
    """A graph's per-row inputs on the device, filled by one copy per step. R rows, M columns.

    One byte buffer holds, in order: the int64 input ids, positions, slots and
    sample rows ([4, R]), the int32 context lengths [R], then a scratch of up to
    R * M int32 where a step's block tables arrive packed to the columns they
    use ([B, C]); each part starts 16-byte aligned. `upload` packs a step's rows
    the same way on the host (Python arrays: a torch.tensor of nested lists
    costs milliseconds at a big batch's tables), sends the prefix it fills in one
    non-blocking copy from pinned memory, and copies the packed tables into
    block_tables_RM[:B, :C] on the device: two operations in the stream, no
    sync. The copy is ordered after the replays already queued, which read
    the buffer first; torch's pinned-memory allocator keeps the host buffer
    until its copy has run. Sample row i is sequence i's last row (row i of a
    decode step), then i itself past the sequences (rows whose logits nobody reads).
    """

    def __init__(self, rows: int, max_blocks: int, device: torch.device):
        self.rows, self.max_blocks, self.device = rows, max_blocks, device
        self._stride = -(-rows // 4) * 4  # rows of each part, so that every part starts 16-byte aligned
        self._i32_at = 4 * self._stride * 8  # byte offset of the int32 part
        self._bytes = torch.zeros(self._i32_at + 4 * (self._stride + rows * max_blocks), dtype=torch.uint8,
                                  device=device)
        i64 = self._bytes[:self._i32_at].view(torch.int64).view(4, self._stride)[:, :rows]
        self.input_ids_R, self.positions_R, self.slots_R, self.sample_rows_R = i64
        self.slots_R.fill_(-1)
        self.sample_rows_R.copy_(torch.arange(rows))
        i32 = self._bytes[self._i32_at:].view(torch.int32)
        self.context_lens_R, self._tables_scratch = i32[:rows], i32[self._stride:]
        self.block_tables_RM = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)

    def upload(self, seqs: Sequence[SeqInput], block_size: int, num_rows: int) -> None:
        """The step's decode rows (a row per new token: expanded where a sequence has several),
        padded to num_rows (<= R) as build_decode_batch pads, into the static inputs; the
        tables take the columns of the longest one."""
        if num_rows > self.rows:
            raise ValueError(f"{num_rows} rows do not fit the static inputs' {self.rows}")
        check_decode_seqs(list(seqs), block_size, num_rows=num_rows, max_blocks=self.max_blocks,
                          max_seq_tokens=num_rows)
        lens = [len(s.token_ids) for s in seqs]
        num_real = sum(lens)
        num_pad, columns = self._stride - num_real, max((len(s.block_table) for s in seqs), default=0)
        zeros64, zero32 = array.array("q", [0]) * num_pad, array.array("i", [0])
        if num_real == len(seqs):  # a decode step: row i is sequence i
            positions = array.array("q", [s.num_computed for s in seqs])
            i64 = array.array("q", [s.token_ids[0] for s in seqs]) + zeros64 + positions + zeros64
            i64 += array.array("q", [s.block_table[s.num_computed // block_size] * block_size
                                     + s.num_computed % block_size for s in seqs])
            last_rows = range(len(seqs))
        else:
            spans = [(s, range(s.num_computed, s.num_computed + len(s.token_ids))) for s in seqs]
            positions = array.array("q", [p for _, span in spans for p in span])
            i64 = array.array("q", [t for s in seqs for t in s.token_ids]) + zeros64 + positions + zeros64
            i64 += array.array("q", [s.block_table[p // block_size] * block_size + p % block_size
                                     for s, span in spans for p in span])
            last_rows = [end - 1 for end in itertools.accumulate(lens)]
        i64 += array.array("q", [-1]) * num_pad  # padding rows write no KV
        i64 += array.array("q", last_rows) + array.array("q", range(len(seqs), self._stride))
        i32 = array.array("i", [p + 1 for p in positions]) + zero32 * num_pad
        for s, num_tokens in zip(seqs, lens):  # an int32 array (the runner's) extends at memcpy speed
            i32.extend(s.block_table)
            i32 += zero32 * (columns - len(s.block_table))
            if num_tokens > 1:  # the other rows of an expanded sequence: its table again
                i32 += i32[-columns:] * (num_tokens - 1)
        i32 += zero32 * ((num_rows - num_real) * columns)
        packed = torch.frombuffer(bytearray(i64) + bytearray(i32), dtype=torch.uint8)
        is_cuda = self.device.type == "cuda"
        self._bytes[:packed.shape[0]].copy_(packed.pin_memory() if is_cuda else packed, non_blocking=is_cuda)
        if num_rows * columns:
            self.block_tables_RM[:num_rows, :columns].copy_(
                self._tables_scratch[:num_rows * columns].view(num_rows, columns))
