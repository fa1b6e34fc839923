"""`BytesAlive`: the most bytes of tensors made within a block that were alive at once, counted op by op.

A real measurement where the allocator has none to give (CPU): every op's outputs that do not share storage with
its inputs are new tensors; their storages are followed by weak reference, and what has been freed is let go
before each op's outputs are counted. Memory made outside torch ops (a `torch.empty` made before the block) is
not counted, nor what an op allocates and frees inside itself.
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
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for ptr, (ref, nbytes) in list(self.alive.items()):
            if ref.expired():
                del self.alive[ptr]
                self.now -= nbytes
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or ptr in self.alive or not storage.nbytes():
                continue  # in place, a view, or counted already
            self.alive[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out
