"""Length-prefixed frames: a msgpack header (msgspec) plus raw tensor bytes. No pickle, no JSON.

    prefix   16 bytes: magic b"SSF1", header length (u32), payload length (u64), big-endian
    header   msgpack of Header: call id, the message (a tagged Struct), tensor descriptors, and
             optionally the W3C trace context of the call (shared/process/tracing.py)
    payload  the tensors' bytes back to back, in descriptor order

A tensor is sent from its own buffer (writelines of memoryviews, no concatenation). On receipt
the payload is read once into a bytearray and tensors are views into it. A tensor may instead
travel as a CUDA IPC handle when both ends share a GPU (cuda_ipc.py); its descriptor then has
nbytes = 0 and the handle.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
import torch

from specserve.shared.wire.messages import Message

MAGIC = b"SSF1"
PREFIX = struct.Struct("!4sIQ")
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024

_DTYPES = {
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _DTYPES.items()}


class TensorMeta(msgspec.Struct, array_like=True):
    name: str
    dtype: str  # one of _DTYPES
    shape: list[int]
    nbytes: int  # bytes of this tensor in the payload; 0 when it travels as a CUDA IPC handle
    ipc: bytes | None = None  # CUDA IPC memory handle (cuda_ipc.py)
    ipc_device: int = -1  # CUDA device index of the IPC allocation
    ipc_offset: int = 0  # byte offset of the tensor inside the IPC allocation


class HandleSharer(Protocol):
    """What a frame needs of a tensor-sharing mechanism (cuda_ipc.CudaIpc): which tensors travel as a
    handle instead of payload bytes, the handle's descriptor, and the tensor a received descriptor names."""

    def accepts(self, tensor: torch.Tensor) -> bool: ...

    def export(self, name: str, tensor: torch.Tensor) -> TensorMeta: ...

    def open(self, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor: ...


class Header(msgspec.Struct, omit_defaults=True):
    """Fields at their default are not sent: a frame without tensors or trace context is what a peer
    before the trace field sent and read (it ignores a field it does not know, and defaults one it misses)."""

    call_id: int  # echoed in the reply; -1 when the request's id could not be read
    body: Message
    tensors: list[TensorMeta] = []
    trace: dict[str, str] | None = None  # W3C carrier (traceparent, tracestate) of the caller's span; optional


class FrameError(Exception):
    """The byte stream cannot be trusted past this point (bad magic, oversized, stalled): close the link."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class MessageError(Exception):
    """A well-framed message that cannot be decoded; the link stays usable."""

    def __init__(self, message: str, call_id: int = -1):
        super().__init__(message)
        self.call_id = call_id


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Header)


class _CallId(msgspec.Struct):
    call_id: int = -1


_call_id_decoder = msgspec.msgpack.Decoder(_CallId)

Tensors = Mapping[str, torch.Tensor]


def encode_frame(call_id: int, body: Message, tensors: Tensors | None = None,
                 ipc: HandleSharer | None = None, trace: dict[str, str] | None = None) -> list[bytes | memoryview]:
    """The frame as a list of buffers for writelines. ipc: a HandleSharer (cuda_ipc.CudaIpc), or None; trace: the
    caller's trace context (shared/process/tracing.py), or None."""
    metas: list[TensorMeta] = []
    buffers: list[bytes | memoryview] = []
    for name, tensor in (tensors or {}).items():
        if tensor.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        if ipc is not None and ipc.accepts(tensor):
            metas.append(ipc.export(name, tensor))
            continue
        raw = _raw_bytes(tensor)
        metas.append(TensorMeta(name, _NAMES[tensor.dtype], list(tensor.shape), len(raw)))
        if len(raw):
            buffers.append(raw)
    header = _encoder.encode(Header(call_id, body, metas, trace))
    payload_len = sum(m.nbytes for m in metas)
    return [PREFIX.pack(MAGIC, len(header), payload_len), header, *buffers]


def _raw_bytes(tensor: torch.Tensor) -> memoryview | bytes:
    """A tensor's bytes as a flat view of its own buffer, copied only when it is not a contiguous CPU
    tensor. The common case (a small CPU index tensor of a step message) goes straight through numpy:
    a few microseconds instead of the detach/to/reshape/view chain's dozen."""
    if not tensor.numel():
        return b""
    if tensor.is_cuda or tensor.requires_grad or not tensor.is_contiguous():
        tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        tensor = tensor.view(torch.int16)
    if not tensor.dim():
        tensor = tensor.reshape(1)
    # ndarray is a buffer, but numpy's stubs declare its __buffer__ only for Python >= 3.12.
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]


def split_flat(values: list[Any], counts: list[int]) -> list[list[Any]]:
    """Cut a flat list (a payload tensor's .tolist()) into consecutive per-entry slices."""
    out: list[list[Any]] = []
    at = 0
    for count in counts:
        out.append(values[at : at + count])
        at += count
    return out


def decode_tensors(metas: list[TensorMeta], payload: bytearray,
                   ipc: HandleSharer | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for meta in metas:
        dtype = _DTYPES.get(meta.dtype)
        if dtype is None:
            raise MessageError(f"tensor {meta.name!r}: unknown dtype {meta.dtype!r}")
        count = 1
        for dim in meta.shape:
            if dim < 0:
                raise MessageError(f"tensor {meta.name!r}: negative dimension in {meta.shape}")
            count *= dim
        if meta.ipc is not None:
            if ipc is None:
                raise MessageError(f"tensor {meta.name!r} came as a CUDA IPC handle, which this link does not accept")
            try:
                out[meta.name] = ipc.open(meta, dtype)
            except Exception as exc:
                raise MessageError(f"tensor {meta.name!r}: its CUDA IPC handle could not be opened "
                                   f"({type(exc).__name__}: {exc})") from None
            continue
        if count * _ITEMSIZE[meta.dtype] != meta.nbytes or offset + meta.nbytes > len(payload):
            raise MessageError(f"tensor {meta.name!r}: shape {meta.shape} of {meta.dtype} does not match "
                               f"its {meta.nbytes} payload bytes")
        flat = (torch.frombuffer(payload, dtype=dtype, count=count, offset=offset) if count
                else torch.empty(0, dtype=dtype))
        out[meta.name] = flat if len(meta.shape) == 1 else flat.view(meta.shape)  # a view costs microseconds
        offset += meta.nbytes
    if offset != len(payload):
        raise MessageError(f"payload has {len(payload) - offset} bytes no tensor describes")
    return out


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, ipc: HandleSharer | None = None,
    timeout_s: float | None = None,
) -> tuple[int, Message, dict[str, torch.Tensor]]:
    """Read one frame (see read_traced_frame)."""
    call_id, body, tensors, _ = await read_traced_frame(reader, max_bytes, ipc, timeout_s)
    return call_id, body, tensors


async def read_traced_frame(
    reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, ipc: HandleSharer | None = None,
    timeout_s: float | None = None,
) -> tuple[int, Message, dict[str, torch.Tensor], dict[str, str] | None]:
    """Read one frame, with its trace context (None if it carried none). Raises IncompleteReadError
    at a clean EOF, FrameError when the stream is unusable, and MessageError (after consuming the
    whole frame) when only its content is bad.

    timeout_s: once the prefix has arrived, the header and payload must follow within this many
    seconds, else FrameError("frame_timeout") (None: no limit). Waiting for a prefix is not limited."""
    header_len, payload_len = frame_lengths(await reader.readexactly(PREFIX.size), max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            header_bytes = await reader.readexactly(header_len)
            payload = bytearray(await reader.readexactly(payload_len)) if payload_len else bytearray()
    except TimeoutError:
        raise FrameError("frame_timeout", f"the frame's {header_len + payload_len} bytes did not arrive within "
                                          f"{timeout_s:g} s of its prefix") from None
    return decode_frame(header_bytes, payload, ipc)


def frame_lengths(prefix: bytes | bytearray | memoryview, max_bytes: int) -> tuple[int, int]:
    """A frame's header and payload lengths from its prefix; FrameError if the stream cannot be trusted."""
    magic, header_len, payload_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise FrameError("malformed_frame", f"bad frame magic {magic!r} (expected {MAGIC!r})")
    if header_len + payload_len > max_bytes:
        raise FrameError("message_too_large",
                         f"frame of {header_len + payload_len} bytes exceeds the limit of {max_bytes} bytes")
    return header_len, payload_len


def decode_frame(header_bytes: bytes | bytearray | memoryview, payload: bytearray, ipc: HandleSharer | None = None,
                 ) -> tuple[int, Message, dict[str, torch.Tensor], dict[str, str] | None]:
    """A whole frame's header and payload decoded: call id, message, tensors (views into `payload`) and
    trace context. MessageError (with the call id where it could be read) if its content is bad."""
    try:
        header = _decoder.decode(header_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            call_id = _call_id_decoder.decode(header_bytes).call_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            call_id = -1
        raise MessageError(f"undecodable message header: {exc}", call_id) from None
    try:
        tensors = decode_tensors(header.tensors, payload, ipc)
    except MessageError as exc:
        exc.call_id = header.call_id
        raise
    return header.call_id, header.body, tensors, header.trace


async def write_frame(writer: asyncio.StreamWriter, call_id: int, body: Message, tensors: Tensors | None = None,
                      ipc: HandleSharer | None = None, trace: dict[str, str] | None = None) -> None:
    write_buffers(writer, encode_frame(call_id, body, tensors, ipc, trace))
    await writer.drain()


def write_buffers(writer: asyncio.StreamWriter | asyncio.WriteTransport, buffers: list[bytes | memoryview]) -> None:
    """writelines (on a stream or a protocol's transport), but a connection the peer has already closed (e.g.
    reset right after connect) raises ConnectionResetError, not uvloop's RuntimeError for a closed handle."""
    if writer.is_closing():
        raise ConnectionResetError("the connection was closed by the peer")
    writer.writelines(buffers)


def frame_bytes(call_id: int, body: Message, tensors: Tensors | None = None) -> bytes:
    """One frame as bytes (tests and benchmarks)."""
    return b"".join(bytes(b) for b in encode_frame(call_id, body, tensors))
