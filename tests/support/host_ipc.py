"""A stand-in for CUDA IPC within one process (CPU storages by handle), and a runner with a deadline."""

from __future__ import annotations

import asyncio

import torch


class HostIpc:
    """Handles to CPU storages within one process, each opened at most once."""

    def __init__(self) -> None:
        self.table: dict[int, torch.UntypedStorage] = {}
        self.shared = self.opened = 0

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def share(self, tensor: torch.Tensor) -> list:
        self.shared += 1
        self.table[self.shared] = tensor.untyped_storage()
        return [self.shared, tensor.untyped_storage().nbytes()]

    def open(self, shared: list, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
        handle, nbytes = shared
        storage = self.table.pop(handle)  # KeyError: never shared, or opened already
        assert storage.nbytes() == nbytes
        self.opened += 1
        return torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, (count,), (1,))


def run(coro, timeout: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))
