"""Ending a gloo rank that torch.multiprocessing.spawn started, in the multi-rank CPU tests."""

import os

import torch.distributed as dist


def leave_rank() -> None:
    """Ends a rank whose work succeeded (its results written or sent: a file, a SimpleQueue, or asserted in
    the rank): every rank past its last collective (a barrier), then the process exits at once with status
    0, without tearing gloo down. A rank that exits while its peer's gloo threads still talk to it made
    that peer abort, and gloo's teardown at exit still aborted a rank now and then after the barrier
    ("terminate called without an active exception", SIGABRT); skipping the destructors avoids both.
    On a failure the worker destroys the group itself and raises, so spawn reports it."""
    dist.barrier()
    os._exit(0)
