"""Scheduling policies: the order in which waiting requests are considered for admission.

A policy only orders; the batcher decides what fits (token budget, running
cap, KV blocks) and stops at the first request that fits on no rank, so a
request is never overtaken by those the policy put behind it. Preempted
requests come first in the waiting list, oldest first.

Priority classes come before any policy: every interactive request is
considered before any batch one (GenerateRequest.priority), and within a class
the policy's order holds (fcfs: first come, first served). A batch request can
wait while interactive ones keep arriving: batch is for work that can wait.

Policies register by name (`--policy`); `make_policy` builds one.

- `fcfs`: first come, first served.
- `lpm`: longest cached prefix first (ties in arrival order), which keeps
  requests that share a prefix together while their blocks are still
  cached. Sorting costs a prefix lookup per waiting request and step, so with
  more than `LPM_MAX_QUEUE` waiting requests it falls back to fcfs. It can
  delay a request without any cached prefix while others keep hitting.
"""

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar

from gateway.requests import Sequence as Seq

POLICIES: dict[str, type["SchedulePolicy"]] = {}

LPM_MAX_QUEUE = 128


def register(cls: type["SchedulePolicy"]) -> type["SchedulePolicy"]:
    """Class decorator: makes the policy available under cls.name."""
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str) -> "SchedulePolicy":
    """The policy registered under name; ValueError naming the known ones otherwise."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(sorted(POLICIES))}, got {name!r}")
    return POLICIES[name]()


class SchedulePolicy(abc.ABC):
    """Orders the waiting requests of one step."""

    name: ClassVar[str]

    def order(self, waiting: Sequence[Seq], cached_tokens: Callable[[Seq], int]) -> Sequence[Seq]:
        """waiting in the order to try them: interactive before batch, each class in the
        policy's order; cached_tokens(seq) is the longest cached prefix the request has on
        any rank (a lookup, computed on demand)."""
        return interactive_first(self.order_in_class(waiting, cached_tokens))

    @abc.abstractmethod
    def order_in_class(self, waiting: Sequence[Seq], cached_tokens: Callable[[Seq], int]) -> Sequence[Seq]:
        """waiting in the policy's order (classes are separated afterwards, keeping it)."""


def interactive_first(seqs: Sequence[Seq]) -> Sequence[Seq]:
    """seqs with every batch request moved behind the interactive ones, each class's order kept."""
    batch = [seq for seq in seqs if seq.request.is_batch]
    if not batch:
        return seqs
    return [seq for seq in seqs if not seq.request.is_batch] + batch


@register
class FirstComeFirstServed(SchedulePolicy):
    name = "fcfs"

    def order_in_class(self, waiting, cached_tokens):
        return waiting


@register
class LongestPrefixMatch(SchedulePolicy):
    name = "lpm"

    def order_in_class(self, waiting, cached_tokens):
        if len(waiting) > LPM_MAX_QUEUE:
            return waiting
        return sorted(waiting, key=lambda seq: -cached_tokens(seq))
