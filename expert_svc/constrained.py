"""Constrained sequences on a rank: their matchers, and their logits masked before sampling.

The gateway has compiled and checked every constraint before admission; the rank that
samples a constrained sequence keeps its `Matcher` (services/constraints.py), writes the
allowed next tokens into a bitmask row before each sampled step and sets the others' logits
to -inf (services/model/constraint_mask.py), for greedy and drawn rows alike, so the sampled
token never leaves the constraint. Unconstrained rows are not touched.

A sampled token stays on the device (the next step's input is gathered there), so a
matcher learns it lazily: the next step that samples the sequence, its forward already
queued, waits for the step before it (that step's event) and reads the tokens from that
step's host copy, accepts them, then computes the masks while the device runs the forward;
a read of the device tensor would wait for that forward too. The bitmask rows go through one
reused host buffer (pinned on CUDA: its upload does not wait for the device). A resumed sequence (re-prefilled after
a preemption or a failover) gets a new matcher that replays the output it already produced
(`NewSequence.constraint_output_ids`). Once a matcher has accepted EOS the sequence is done
at the gateway; the one step the gateway may still have planned for it runs unmasked.

Jump-forward (docs/internals.md), for the sequences whose gateway takes jumps
(NewSequence.is_jump_forward; the others pay none of this): where the constraint allows one text
only, the row allows only the first of its forced tokens (the tokenizer's encoding of that text),
so the model never picks another tokenization of it; a chunk's forced tokens
(ScheduledSequence.num_forced) are accepted before the mask; and each masked row's matcher is
copied, so that the step's reader can advance the copy over the sampled token and report the
tokens forced after it (StepResult.forced) without touching the matchers the next step uses.

The Compiler (the tokenizer's vocabulary in llguidance, ~150 MB) is built on the first
constrained sequence, so a rank that never sees one pays nothing.
"""

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from services.constraints import Compiler, Matcher, fill_masks
from services.model.batch import to_device
from services.model.constraint_mask import apply_token_bitmask_
from services.step import NewSequence

# A token a sequence sampled that its matcher has not accepted yet: (the step's tokens on the
# host, its row, the torch.cuda.Event after which they are there, or None when they are already).
Unaccepted = tuple[Tensor, int, "torch.cuda.Event | None"]


class ConstraintMasks:
    """The rank's constrained decoding: matchers for new sequences and the masks of a step."""

    def __init__(self, make_compiler: Callable[[], Compiler] | None = None) -> None:
        """make_compiler: builds the Compiler for the served model's tokenizer and logits
        width; None refuses constrained sequences (a rank with no tokenizer)."""
        self._make_compiler = make_compiler
        self._compiler: Compiler | None = None
        self._buffer = _MaskBuffer()

    def matcher(self, new: NewSequence) -> Matcher:
        """The matcher of a new constrained sequence, past the output it already has;
        ValueError (a refused plan) if this rank cannot honour it."""
        if self._make_compiler is None:
            raise ValueError(f"sequence {new.seq_id} is constrained, but this rank has no tokenizer to compile it")
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler.matcher(new.constraint, new.constraint_output_ids)

    def mask(self, logits_SV: Tensor, greedy_S: Tensor | None, rows: Sequence[int], matchers: Sequence[Matcher],
             unaccepted: Sequence[Unaccepted | None], forced_inputs: Sequence[Sequence[int]] = (),
             is_jump_forward: Sequence[bool] = ()) -> tuple[Tensor | None, list[tuple[int, Matcher]]]:
        """Masks logits_SV's `rows` in place by their matchers, after accepting each one's
        unaccepted token (Unaccepted, or None), then its forced_inputs (a jump-forward chunk's
        forced tokens). A jump-forward row (is_jump_forward, default none) allows only the first
        of the tokens its constraint forces, where it forces some. Returns greedy_S with those
        rows' argmax taken again (None stays None: the sampler takes the argmax itself), and (row,
        a copy of its matcher) per masked jump-forward row: StepRunner.finish advances the copies
        over the sampled tokens to find what they force."""
        with torch.inference_mode():  # the forward's logits are inference tensors
            return self._mask(logits_SV, greedy_S, rows, matchers, unaccepted, forced_inputs,
                              is_jump_forward or [False] * len(rows))

    def _mask(self, logits_SV, greedy_S, rows, matchers, unaccepted, forced_inputs, is_jump_forward):
        _accept(matchers, unaccepted)
        for matcher, token_ids in zip(matchers, forced_inputs):
            if token_ids and not all(matcher.accept(t) for t in token_ids):
                raise RuntimeError(f"a jump-forward chunk's forced tokens {list(token_ids)} break the constraint")
        live = [(row, m, jf) for row, m, jf in zip(rows, matchers, is_jump_forward) if not m.is_terminated()]
        if not live:
            return greedy_S, []
        rows, matchers = [row for row, _, _ in live], [m for _, m, _ in live]
        bitmask_CW = self._buffer.take(len(rows), self._compiler.mask_words)
        # Where a jump-forward row's constraint allows one text only, its tokenizer's first token:
        # the tokens a chunk feeds are then the ones decoding step by step gives.
        forced = [m.forced_token_ids() if jf else () for _, m, jf in live]
        free = [c for c, tokens in enumerate(forced) if not tokens]
        if len(free) == len(rows):
            fill_masks(bitmask_CW, matchers)
        else:
            words_CW = bitmask_CW.view(np.uint32)
            for c, tokens in enumerate(forced):
                if tokens:
                    words_CW[c] = 0
                    words_CW[c, tokens[0] >> 5] = 1 << (tokens[0] & 31)
            if free:   # rows 0..k-1 of the buffer's spare space: fill_masks writes consecutive rows
                free_CW = self._buffer.spare(len(free), bitmask_CW.shape[1])
                fill_masks(free_CW, [matchers[c] for c in free])
                bitmask_CW[free] = free_CW
        self._buffer.upload(logits_SV, bitmask_CW, rows)
        copies = [(row, m.copy()) for row, m, jf in live if jf]
        if greedy_S is None:
            return None, copies
        rows_C = to_device(torch.tensor(rows, dtype=torch.int64), logits_SV.device)
        return greedy_S.clone().index_copy_(0, rows_C, logits_SV.index_select(0, rows_C).argmax(dim=-1)), copies


class _MaskBuffer:
    """The step's bitmask rows, in one host buffer reused from step to step (pinned on CUDA, so
    the upload does not wait for the device); before rows are rewritten, the upload that read
    them last has finished (an event, which a constrained step's wait for its tokens has
    usually passed already)."""

    def __init__(self) -> None:
        self._host_RW: Tensor | None = None
        self._uploaded = None   # torch.cuda.Event after the last upload from the buffer

    def take(self, num_rows: int, num_words: int) -> np.ndarray:
        """num_rows rows (twice that reserved: `spare`), contents undefined; fill_masks writes whole rows."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None
        if self._host_RW is None or self._host_RW.shape[0] < 2 * num_rows or self._host_RW.shape[1] != num_words:
            rows = max(2 * num_rows, 16)
            self._host_RW = torch.empty((rows, num_words), dtype=torch.int32, pin_memory=torch.cuda.is_available())
        return self._host_RW[:num_rows].numpy()

    def spare(self, num_rows: int, num_words: int) -> np.ndarray:
        """num_rows rows after take()'s, for a partial fill."""
        return self._host_RW[-num_rows:].numpy()

    def upload(self, logits_SV: Tensor, bitmask_CW: np.ndarray, rows: Sequence[int]) -> None:
        """Masks logits_SV's rows by bitmask_CW (rows of this buffer)."""
        apply_token_bitmask_(logits_SV, self._host_RW[:len(rows)], rows)
        if logits_SV.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()


def _accept(matchers: Sequence[Matcher], unaccepted: Sequence[Unaccepted | None]) -> None:
    """Accepts each matcher's token sampled in an earlier step, from that step's host copy: it
    waits for that step only, not for the forward just queued after it, so the masks are
    computed while the device runs it."""
    pending = [(m, token) for m, token in zip(matchers, unaccepted) if token is not None and not m.is_terminated()]
    if not pending:
        return
    lists = {}
    for _, (host_S, _, ready) in pending:
        if id(host_S) not in lists:
            if ready is not None:
                ready.synchronize()
            lists[id(host_S)] = host_S.tolist()
    for matcher, (host_S, row, _) in pending:
        token_id = lists[id(host_S)][row]
        if not matcher.accept(token_id):
            # The mask allowed only what the matcher accepts: a broken invariant, not bad input.
            raise RuntimeError(f"a constrained sequence sampled token {token_id}, which its constraint refuses")
