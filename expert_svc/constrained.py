"""Constrained sequences on a rank: their matchers, and their logits masked before sampling.

The gateway has compiled and checked every constraint before admission; the rank that
samples a constrained sequence keeps its `Matcher` (services/constraints.py), writes the
allowed next tokens into a bitmask row before each sampled step and sets the others' logits
to -inf (services/model/constraint_mask.py), for greedy and drawn rows alike, so the sampled
token never leaves the constraint. Unconstrained rows are not touched.

A sampled token stays on the device (the next step's input is gathered there), so a
matcher learns it lazily: the next step that samples the sequence first reads back the
tokens its constrained rows left unaccepted (one host read for all of them), accepts them,
then computes the masks. A step with constrained rows therefore waits for the step before
it; steps without any keep the launch-ahead pipeline. A resumed sequence (re-prefilled after
a preemption or a failover) gets a new matcher that replays the output it already produced
(`NewSequence.constraint_output_ids`). Once a matcher has accepted EOS the sequence is done
at the gateway; the one step the gateway may still have planned for it runs unmasked.

Jump-forward (docs/internals.md): where the constraint allows one text only, the row allows only
the first of its forced tokens (the tokenizer's encoding of that text), so the model never picks
another tokenization of it; a chunk's forced tokens (ScheduledSequence.num_forced) are accepted
before the mask; and each masked row's matcher is copied, so that the step's reader can
advance the copy over the sampled token and report the tokens forced after it (StepResult.forced)
without touching the matchers the next step uses.

The Compiler (the tokenizer's vocabulary in llguidance, ~150 MB) is built on the first
constrained sequence, so a rank that never sees one pays nothing.
"""

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from services.constraints import Compiler, Matcher, fill_masks
from services.model.constraint_mask import apply_token_bitmask_
from services.step import NewSequence


class ConstraintMasks:
    """The rank's constrained decoding: matchers for new sequences and the masks of a step."""

    def __init__(self, make_compiler: Callable[[], Compiler] | None = None) -> None:
        """make_compiler: builds the Compiler for the served model's tokenizer and logits
        width; None refuses constrained sequences (a rank with no tokenizer)."""
        self._make_compiler = make_compiler
        self._compiler: Compiler | None = None

    def matcher(self, new: NewSequence) -> Matcher:
        """The matcher of a new constrained sequence, past the output it already has;
        ValueError (a refused plan) if this rank cannot honour it."""
        if self._make_compiler is None:
            raise ValueError(f"sequence {new.seq_id} is constrained, but this rank has no tokenizer to compile it")
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler.matcher(new.constraint, new.constraint_output_ids)

    def mask(self, logits_SV: Tensor, greedy_S: Tensor | None, rows: Sequence[int], matchers: Sequence[Matcher],
             unaccepted: Sequence[tuple[Tensor, int] | None],
             forced_inputs: Sequence[Sequence[int]] = ()) -> tuple[Tensor | None, list[tuple[int, Matcher]]]:
        """Masks logits_SV's `rows` in place by their matchers, after accepting each one's
        unaccepted token (a device tensor and its row, or None), then its forced_inputs (a
        jump-forward chunk's forced tokens). Where the constraint forces tokens, the row allows
        only the first. Returns greedy_S with those rows' argmax taken again (None stays None:
        the sampler takes the argmax itself), and (row, a copy of its matcher) per masked row:
        StepRunner.finish advances the copies over the sampled tokens to find what they force."""
        with torch.inference_mode():  # the forward's logits are inference tensors
            return self._mask(logits_SV, greedy_S, rows, matchers, unaccepted, forced_inputs)

    def _mask(self, logits_SV, greedy_S, rows, matchers, unaccepted, forced_inputs):
        _accept(matchers, unaccepted)
        for matcher, token_ids in zip(matchers, forced_inputs):
            if token_ids and not all(matcher.accept(t) for t in token_ids):
                raise RuntimeError(f"a jump-forward chunk's forced tokens {list(token_ids)} break the constraint")
        live = [(row, m) for row, m in zip(rows, matchers) if not m.is_terminated()]
        if not live:
            return greedy_S, []
        rows, matchers = [row for row, _ in live], [m for _, m in live]
        bitmask_CW = np.zeros((len(rows), self._compiler.mask_words), dtype=np.int32)
        forced = [m.forced_token_ids() for m in matchers]
        free = [c for c, tokens in enumerate(forced) if not tokens]
        if len(free) == len(rows):
            fill_masks(bitmask_CW, matchers)
        else:
            # Where the constraint allows one text only, its tokenizer's first token: the tokens
            # a jump-forward chunk feeds are the same, with or without jump-forward.
            for c, tokens in enumerate(forced):
                if tokens:
                    bitmask_CW.view(np.uint32)[c, tokens[0] >> 5] = np.uint32(1 << (tokens[0] & 31))
            if free:
                free_CW = np.zeros((len(free), bitmask_CW.shape[1]), dtype=np.int32)
                fill_masks(free_CW, [matchers[c] for c in free])
                bitmask_CW[free] = free_CW
        apply_token_bitmask_(logits_SV, bitmask_CW, rows)
        copies = [(row, m.copy()) for row, m in live]
        if greedy_S is None:
            return None, copies
        rows_C = torch.tensor(rows, dtype=torch.int64).to(logits_SV.device, non_blocking=True)
        return greedy_S.clone().index_copy_(0, rows_C, logits_SV.index_select(0, rows_C).argmax(dim=-1)), copies


def _accept(matchers: Sequence[Matcher], unaccepted: Sequence[tuple[Tensor, int] | None]) -> None:
    """Accepts each matcher's token sampled in an earlier step: one host read for all."""
    pending = [(m, token) for m, token in zip(matchers, unaccepted) if token is not None and not m.is_terminated()]
    if not pending:
        return
    token_ids = torch.stack([tokens_S[row] for _, (tokens_S, row) in pending]).tolist()
    for (matcher, _), token_id in zip(pending, token_ids):
        if not matcher.accept(token_id):
            # The mask allowed only what the matcher accepts: a broken invariant, not bad input.
            raise RuntimeError(f"a constrained sequence sampled token {token_id}, which its constraint refuses")
