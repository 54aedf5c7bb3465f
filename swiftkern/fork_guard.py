"""A process forked after torch's CPU threads ran: say why its first call may hang.

torch's CPU wheels run their thread pool on GNU OpenMP (libgomp), which does not survive
``fork()``: once the parent has run a parallel region (any large torch op, a swiftkern
generate), the child's first parallel region at more than one thread waits forever for the
parent's worker threads, which the child does not have. A plain ``a @ a`` hangs the same way;
swiftkern cannot mend it. What it can do is say so before it happens: the first CPU call in a
forked child whose torch runs more than one thread warns once, naming the two fixes
(``torch.set_num_threads(1)`` in the child, or ``spawn`` / ``forkserver`` workers). Each of
swiftkern's CPU kernels gives the same bits at any thread count, so the first fix changes
speed, not tokens. (A fork while another thread is inside a call is not mended either: the
child inherits the model's lock held.)
"""

from __future__ import annotations

import os
import warnings

import torch

_forked = False  # this process is a fork() child of one that had imported swiftkern (so torch)
_warned = False


def _mark_forked() -> None:
    global _forked, _warned
    _forked, _warned = True, False


os.register_at_fork(after_in_child=_mark_forked)


def openmp_backend() -> bool:
    """Whether torch's intra-op pool is OpenMP (torch's Linux CPU and CUDA wheels)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def warn_if_forked_with_threads(device: torch.device) -> None:
    """Warn once per forked process, before the first CPU call at more than one torch thread."""
    global _warned
    if not _forked or _warned or device.type != "cpu" or torch.get_num_threads() <= 1:
        return
    _warned = True
    if openmp_backend():
        warnings.warn(
            f"swiftkern: this process was forked from one that had imported torch, and torch runs "
            f"{torch.get_num_threads()} OpenMP threads here. GNU OpenMP does not survive fork(): if the parent "
            f"ran a parallel region before the fork (a large torch op: loading a model, a generate), this call "
            f"hangs in its first one, as a plain torch matmul would. Call torch.set_num_threads(1) in the "
            f"child (swiftkern's C++ kernels give the same tokens at any thread count), or start workers "
            f"with multiprocessing's 'spawn' or 'forkserver' method", RuntimeWarning, stacklevel=3)
