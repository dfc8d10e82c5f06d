"""CUDA IPC's lifecycle (shared/wire/cuda_ipc.py) without a GPU: a host-memory backend of torch's shape.

`HostIpc` names a storage by a handle in a table, as a cudaIpcMemHandle names a device allocation, and
holds it there until the receiver opened it (torch's cross-process reference counter), so a handle that
is opened twice, never shared, or never opened is seen. The frames and the RPC links are the real ones,
over a real socket; only the memory handle is host memory. `TorchCudaIpc` itself runs in
bench/gpu_suite.py on a GPU.

Here: the tests that start no process and open no socket; the others are in tests/service/test_cuda_ipc.py.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from specserve.shared.wire import cuda_ipc
from specserve.shared.wire.cuda_ipc import CudaIpc
from specserve.shared.wire.messages import Health
from specserve.shared.wire.transport import PREFIX, Header, MessageError, TensorMeta, encode_frame, read_frame
from tests.support.host_ipc import HostIpc, run


async def read_frames(buffers: list, ipc: CudaIpc | None, count: int = 1) -> list:
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(bytes(b) for b in buffers))
    reader.feed_eof()
    out = []
    for _ in range(count):
        try:
            out.append(await read_frame(reader, ipc=ipc))
        except MessageError as exc:
            out.append(exc)
    return out


def test_a_tensor_travels_as_a_handle_and_arrives_as_the_receivers_own_copy():
    fake = HostIpc()
    sender, receiver = CudaIpc(fake), CudaIpc(fake)
    base = torch.arange(40, dtype=torch.float32).view(8, 5)
    tensors = {"rows": base[2:5], "tokens": torch.tensor([7, 8, 9], dtype=torch.int32),
               "half": torch.randn(4, 3).to(torch.bfloat16), "empty": torch.empty(0, dtype=torch.int64)}
    frame = encode_frame(3, Health(), tensors, sender)
    assert PREFIX.unpack(frame[0])[2] == 0  # no payload bytes: every non-empty tensor went as a handle
    assert len(sender.kept) == 3 and fake.shared == 3
    ((call_id, _, got),) = run(read_frames(frame, receiver))
    assert call_id == 3 and list(got) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype
    assert fake.table == {} and fake.opened == 3  # each handle opened once, then let go
    base.fill_(-1)  # the sender reuses its memory: the receiver holds its own copy
    assert torch.equal(got["rows"], torch.arange(10, 25, dtype=torch.float32).view(3, 5))
    sender.new_frame()  # the next frame: the previous frame's tensors may be freed
    assert sender.kept == []


def test_a_handle_the_link_does_not_take_or_cannot_open_is_a_message_error_and_the_stream_stays_aligned():
    fake = HostIpc()
    sent = encode_frame(1, Health(), {"x": torch.ones(4)}, CudaIpc(fake))
    forged = encode_frame(2, Health(), {"x": torch.ones(4)}, CudaIpc(fake))
    fake.table.clear()  # frame 2's handle now names nothing
    plain = encode_frame(3, Health(), {"x": torch.ones(2)})
    refused, after = run(read_frames(sent + plain, None, 2))  # a link without IPC
    assert isinstance(refused, MessageError) and "does not accept" in str(refused)
    assert torch.equal(after[2]["x"], torch.ones(2))
    unopened, after = run(read_frames(forged + plain, CudaIpc(fake), 2))
    assert isinstance(unopened, MessageError) and "could not be opened" in str(unopened)
    assert after[0] == 3


def test_a_negative_dimension_in_a_handles_descriptor_is_refused_before_opening():
    fake = HostIpc()
    frame_prefix, header = encode_frame(1, Health(), {"x": torch.ones(4)}, CudaIpc(fake))
    decoded = msgspec.msgpack.decode(header, type=Header)
    meta = decoded.tensors[0]
    decoded.tensors = [TensorMeta(meta.name, meta.dtype, [-4], 0, meta.ipc, meta.ipc_device, meta.ipc_offset)]
    bad = msgspec.msgpack.encode(decoded)
    prefix = PREFIX.pack(*PREFIX.unpack(frame_prefix)[:1], len(bad), 0)
    (err,) = run(read_frames([prefix, bad], CudaIpc(fake)))
    assert isinstance(err, MessageError) and "negative dimension" in str(err)
    assert fake.opened == 0


def test_without_a_gpu_the_torch_backend_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(cuda_ipc.CudaIpcUnavailable, match="needs a CUDA device"):
        CudaIpc()
