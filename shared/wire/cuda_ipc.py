"""CUDA IPC for frame tensors: a CUDA tensor travels as a memory handle instead of payload bytes.

Used only when both ends of a link run on one GPU host and the link opts in; everything else goes
through the socket payload (transport.py). `TorchCudaIpc` exports with torch's own IPC sharing of the
tensor's storage (`_share_cuda_`: the allocation's cudaIpcMemHandle, the storage's offset inside the
caching allocator's block, and torch's cross-process reference counter), packed as msgpack, never pickle.

The lifecycle, one `CudaIpc` per link end:
- the sender exports a frame's tensors and keeps them alive until its next frame on the link (calls
  alternate, so by then the peer has read the frame; torch's reference counter also keeps a block
  whose handle is still unopened from being reused);
- the receiver opens each handle once, copies the bytes into its own tensor at once and lets the
  shared storage go.

The backend is a seam: `CudaIpc(backend)` takes anything with `accepts`, `share` and `open`, and
`default_backend()` is what the RPC links build. The tests run the whole lifecycle over real sockets
with a host-memory backend of the same shape (tests/unit/test_cuda_ipc.py); `TorchCudaIpc` itself runs only
on a GPU (bench/gpu_suite.py).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import msgspec
import torch

from specserve.shared.wire.transport import _NAMES, TensorMeta


class CudaIpcUnavailable(RuntimeError):
    pass


class IpcBackend(Protocol):
    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this tensor travels as a handle (else as payload bytes)."""

    def share(self, tensor: torch.Tensor) -> list[Any]:
        """The handle of a contiguous tensor's storage, as msgpack-able values."""

    def open(self, shared: list[Any], dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
        """A flat view of `count` elements at byte `offset` in the storage `shared` names."""


class TorchCudaIpc:
    """torch's CUDA IPC: cudaIpcMemHandle plus torch's reference counter."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise CudaIpcUnavailable("CUDA IPC needs a CUDA device")

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def share(self, tensor: torch.Tensor) -> list[Any]:
        # (device, handle, size, offset, refcounter handle, refcounter offset, event handle, event sync)
        return list(tensor.untyped_storage()._share_cuda_())

    def open(self, shared: list[Any], dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
        # CUDA must be initialized in this process before a handle is opened (torch's own rebuild_cuda_tensor
        # does the same): a process whose first CUDA call is this one crashes (segfault, seen on an H200)
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(*shared)
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset // dtype.itemsize, (count,),
                                                                       (1,))


def default_backend() -> IpcBackend:
    return TorchCudaIpc()


class CudaIpc:
    """Export (sender) and open (receiver) for one link end."""

    def __init__(self, backend: IpcBackend | None = None) -> None:
        self.backend = backend if backend is not None else default_backend()
        self.kept: list[torch.Tensor] = []  # the last outgoing frame's exported tensors

    def new_frame(self) -> None:
        """Called before each outgoing frame: the previous frame's tensors may now be freed."""
        self.kept.clear()

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` goes as a handle: a non-empty tensor the backend takes (an empty one costs no bytes)."""
        return tensor.numel() > 0 and self.backend.accepts(tensor)

    def export(self, name: str, tensor: torch.Tensor) -> TensorMeta:
        tensor = tensor.detach().contiguous()
        self.kept.append(tensor)
        shared = self.backend.share(tensor)
        offset = int(tensor.storage_offset()) * tensor.element_size()  # bytes into the shared storage
        return TensorMeta(name, _NAMES[tensor.dtype], list(tensor.shape), 0, msgspec.msgpack.encode(shared),
                          tensor.device.index or 0, offset)

    def open(self, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor:
        shared = msgspec.msgpack.decode(cast(bytes, meta.ipc))  # only called for a meta with a handle
        count = 1
        for dim in meta.shape:
            count *= dim
        view = self.backend.open(shared, dtype, count, meta.ipc_offset)
        return view.clone().view(meta.shape)  # our own copy; the handle's storage may go
