"""`BytesAlive`: the most bytes of tensors made within a block that were alive at once, counted op by op.

A real measurement where the allocator has none to give (CPU): every op's outputs that do not share storage with
its inputs are new tensors; their storages are followed by weak reference, and what has been freed is let go
before each op's outputs are counted. Memory made outside torch ops (a `torch.empty` made before the block) is
not counted, nor what an op allocates and frees inside itself, nor MKL's packed weights (opaque tensors, no
storage to follow). `largest` is the biggest single storage made.

It lives with the benchmarks because it is a measuring instrument: `memory_pieces.py` prints figures with it and
the tests hold those figures with it (`from benchmarks.bytes_alive import BytesAlive`, the repository root being
on sys.path under `python -m pytest`). In `grpo/` it would ship with the package that never runs it; in `tests/`
a benchmark would reach into the test suite.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class BytesAlive(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}  # data pointer -> (weak storage, bytes)
        self.now = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_storage(t).data_ptr() for t in tree_leaves((args, kwargs)) if _storage(t) is not None}
        out = func(*args, **kwargs)
        for ptr, (ref, nbytes) in list(self.alive.items()):
            if ref.expired():
                del self.alive[ptr]
                self.now -= nbytes
        for t in tree_leaves(out):
            storage = _storage(t)
            if storage is None:
                continue
            ptr = storage.data_ptr()
            if ptr in inputs or ptr in self.alive or not storage.nbytes():
                continue  # in place, a view, or counted already
            self.alive[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self.now += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
        self.peak = max(self.peak, self.now)
        return out


def _storage(t):
    """A tensor's storage; None for what is no tensor or has none to follow (an opaque MKL-packed weight)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except NotImplementedError:
        return None
