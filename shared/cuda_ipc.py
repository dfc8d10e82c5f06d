"""CUDA IPC for frame tensors: a CUDA tensor travels as a memory handle instead of payload bytes.

Used only when both ends of a link run on one GPU host and the link opts in; everything else goes
through the socket payload (transport.py). Export uses torch's own IPC sharing of the tensor's
storage (`_share_cuda_`: the allocation's cudaIpcMemHandle, the storage's offset inside the caching
allocator's block, and torch's cross-process reference counter), packed as msgpack, never pickle.
The sender keeps the tensor alive until its next frame on the link (calls alternate, so by then the
peer has read it); the receiver copies the bytes into its own tensor at once.

Not exercised on CPU machines: the socket path is the tested one.
"""

from __future__ import annotations

from typing import cast

import msgspec
import torch

from specserve.shared.transport import _NAMES, TensorMeta


class CudaIpcUnavailable(RuntimeError):
    pass


class CudaIpc:
    """Export (sender) and open (receiver) for one link."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise CudaIpcUnavailable("CUDA IPC needs a CUDA device")
        self._keep_alive: list[torch.Tensor] = []

    def new_frame(self) -> None:
        """Called before each outgoing frame: the previous frame's tensors may now be freed."""
        self._keep_alive.clear()

    def export(self, name: str, tensor: torch.Tensor) -> TensorMeta:
        tensor = tensor.detach().contiguous()
        self._keep_alive.append(tensor)
        shared = tensor.untyped_storage()._share_cuda_()  # (device, handle, size, offset, refcounter..., event...)
        offset = int(tensor.storage_offset()) * tensor.element_size()  # bytes into the shared storage
        return TensorMeta(name, _NAMES[tensor.dtype], list(tensor.shape), 0, msgspec.msgpack.encode(list(shared)),
                          tensor.device.index or 0, offset)

    def open(self, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor:
        shared = msgspec.msgpack.decode(cast(bytes, meta.ipc))  # only called for a meta with a handle
        storage = torch.UntypedStorage._new_shared_cuda(*shared)
        count = 1
        for dim in meta.shape:
            count *= dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        view = torch.empty(0, dtype=dtype, device=storage.device).set_(
            storage, meta.ipc_offset // itemsize, (count,), (1,))
        return view.clone().view(meta.shape)  # our own copy; the handle's storage may go
