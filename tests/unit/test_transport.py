"""Frames and RPC over real sockets: tensor round trips, an echo server, and bad input.

Everything runs in-process (asyncio.run inside plain test functions) over TCP on 127.0.0.1 port 0
or a Unix socket under tmp_path. Malformed frames are built by hand from Header/TensorMeta and
PREFIX and fed to an asyncio.StreamReader. Tensors are compared bit for bit (dtype, shape and
bytes), so NaN payloads and signed zeros must survive too.

Here: the tests that start no process and open no socket; the others are in tests/service/test_transport.py.
"""

from __future__ import annotations

import asyncio
import math
import warnings

import msgspec
import numpy as np
import pytest
import torch

from specserve.shared.wire.messages import (
    Health,
    Stats,
)
from specserve.shared.wire.rpc import (
    TRANSPORT_ERRORS,
    RemoteError,
    ReplyOutOfStep,
    UnexpectedReply,
    parse_address,
)
from specserve.shared.wire.transport import (
    MAGIC,
    PREFIX,
    FrameError,
    Header,
    MessageError,
    TensorMeta,
    decode_tensors,
    encode_frame,
    frame_bytes,
    read_frame,
)
from tests.support.echo import assert_same, bits, run

DTYPES = [torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.bool]




def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns of `dtype` (floats include NaNs, infinities and -0.0); bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).view(shape)






async def read_all(data: bytes, count: int, max_bytes: int | None = None) -> list:
    """Read `count` frames from `data`; each item is (call_id, body, tensors) or the exception raised."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out = []
    for _ in range(count):
        try:
            out.append(await (read_frame(reader) if max_bytes is None else read_frame(reader, max_bytes=max_bytes)))
        except Exception as exc:  # the test inspects what was raised
            out.append(exc)
    return out


def raw_frame(call_id: int, metas: list[TensorMeta], payload: bytes, body=None) -> bytes:
    """A frame built by hand, so that it can lie about its tensors."""
    header = msgspec.msgpack.encode(Header(call_id, Health() if body is None else body, metas))
    return PREFIX.pack(MAGIC, len(header), len(payload)) + header + payload


# ---- 1. tensor round trips ---------------------------------------------------------------------


def layouts(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    transposed = random_tensor(dtype, (3, 5), 1).t()
    strided = random_tensor(dtype, (17,), 2)[1::4]
    permuted = random_tensor(dtype, (2, 3, 4), 3).permute(2, 0, 1)
    assert not transposed.is_contiguous() and not strided.is_contiguous() and not permuted.is_contiguous()
    return {
        "scalar": random_tensor(dtype, (), 4),
        "empty": random_tensor(dtype, (0,), 5),
        "empty_3d": random_tensor(dtype, (2, 0, 3), 6),
        "vector": random_tensor(dtype, (7,), 7),
        "cube": random_tensor(dtype, (2, 3, 4), 8),
        "transposed": transposed,
        "strided": strided,
        "permuted": permuted,
        "offset_slice": random_tensor(dtype, (10,), 9)[3:8],  # contiguous, nonzero storage offset
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_layout(dtype):
    sent = layouts(dtype)
    before = {name: bits(t).clone() for name, t in sent.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch.frombuffer over a read-only buffer warns
        [(call_id, body, got)] = run(read_all(frame_bytes(42, Health(), sent), 1))
        assert call_id == 42
        assert body == Health()
        assert list(got) == list(sent)
        for name, tensor in sent.items():
            assert_same(got[name], tensor)
        for name, tensor in got.items():  # writable, and not aliasing the sender's tensors
            tensor.fill_(1)
            assert torch.equal(bits(tensor), bits(torch.ones_like(tensor)))
            assert torch.equal(bits(sent[name]), before[name])


def test_round_trip_mixed_dtypes_at_unaligned_offsets():
    # 3 uint8 bytes and 1 bool first: every later tensor starts at an odd payload offset.
    sent = {"u8": random_tensor(torch.uint8, (3,), 10), "flag": torch.tensor([True])}
    for i, dtype in enumerate(DTYPES):
        sent[f"t{i}"] = random_tensor(dtype, (2, 3), 20 + i).t()
    frame = frame_bytes(3, Health(), sent)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [(call_id, _, got)] = run(read_all(frame, 1))
        assert call_id == 3
        assert list(got) == list(sent)
        for name, tensor in sent.items():
            assert_same(got[name], tensor)
            got[name].zero_()


def test_decode_tensors_directly():
    payload = bytearray(np.array([1, -2, 3], dtype="<i4").tobytes() + bytes([1, 0]))
    metas = [
        TensorMeta("a", "int32", [3], 12), TensorMeta("b", "bool", [1, 2], 2), TensorMeta("c", "float16", [0, 4], 0),
    ]
    got = decode_tensors(metas, payload)
    assert list(got) == ["a", "b", "c"]
    assert torch.equal(got["a"], torch.tensor([1, -2, 3], dtype=torch.int32))
    assert torch.equal(got["b"], torch.tensor([[True, False]]))
    assert got["c"].dtype == torch.float16 and tuple(got["c"].shape) == (0, 4)
    got["a"][0] = 7  # views into the payload: writes land in it
    assert payload[:4] == np.array([7], dtype="<i4").tobytes()


# ---- 7. encode_frame does not concatenate ----------------------------------------------------


def test_encode_frame_sends_each_tensor_from_its_own_buffer():
    a = torch.tensor([1, 2, 3], dtype=torch.int32)
    b = torch.arange(4, dtype=torch.float16).view(2, 2).t()  # non-contiguous: copied once, still separate
    parts = encode_frame(5, Health(), {"a": a, "e": torch.empty(0), "b": b})
    assert len(parts) == 4  # prefix, header, a, b (the empty tensor contributes no buffer)
    prefix, header, buf_a, buf_b = parts
    assert PREFIX.unpack(prefix) == (MAGIC, len(header), 12 + 8)
    assert msgspec.msgpack.decode(header, type=Header) == Header(5, Health(), [
        TensorMeta("a", "int32", [3], 12), TensorMeta("e", "float32", [0], 0), TensorMeta("b", "float16", [2, 2], 8),
    ])
    assert isinstance(buf_a, memoryview) and isinstance(buf_b, memoryview)
    assert buf_a.nbytes == 12 and buf_b.nbytes == 8
    assert bytes(buf_a) == a.numpy().tobytes()
    assert bytes(buf_b) == b.contiguous().numpy().tobytes()
    # A contiguous CPU tensor is not copied: its buffer is the tensor's own memory.
    assert np.frombuffer(buf_a, dtype=np.uint8).ctypes.data == a.data_ptr()
    assert frame_bytes(5, Health(), {"a": a, "e": torch.empty(0), "b": b}) == b"".join(bytes(p) for p in parts)
    assert len(encode_frame(6, Health())) == 2


def test_encode_frame_refuses_unsupported_dtype():
    with pytest.raises(TypeError, match="tensor 'x' has unsupported dtype torch.float64"):
        encode_frame(1, Health(), {"x": torch.zeros(2, dtype=torch.float64)})


# ---- 4./5. bad frames --------------------------------------------------------------------------

BAD_CONTENT = {
    "payload_too_short": (
        [TensorMeta("t", "int32", [4], 16)], bytes(8),
        "tensor 't': shape [4] of int32 does not match its 16 payload bytes"),
    "nbytes_disagrees_with_shape": (
        [TensorMeta("t", "int32", [3], 16)], bytes(16),
        "tensor 't': shape [3] of int32 does not match its 16 payload bytes"),
    "second_tensor_past_the_end": (
        [TensorMeta("a", "uint8", [2], 2), TensorMeta("b", "int64", [1], 8)], bytes(6),
        "tensor 'b': shape [1] of int64 does not match its 8 payload bytes"),
    "negative_dimension": (
        [TensorMeta("t", "int32", [2, -2], 16)], bytes(16), "tensor 't': negative dimension in [2, -2]"),
    "unknown_dtype": ([TensorMeta("t", "float64", [1], 8)], bytes(8), "tensor 't': unknown dtype 'float64'"),
    "undescribed_payload": ([TensorMeta("t", "uint8", [2], 2)], bytes(5), "payload has 3 bytes no tensor describes"),
    "ipc_handle_not_accepted": (
        [TensorMeta("t", "int32", [1], 0, ipc=b"\x00" * 64, ipc_device=0)], b"",
        "tensor 't' came as a CUDA IPC handle, which this link does not accept"),
}


@pytest.mark.parametrize("case", list(BAD_CONTENT))
def test_bad_tensor_descriptor_is_a_message_error_and_the_stream_stays_aligned(case):
    metas, payload, message = BAD_CONTENT[case]
    good = torch.tensor([9, 8, 7], dtype=torch.int32)
    data = raw_frame(77, metas, payload) + frame_bytes(78, Health(), {"ok": good})
    bad, (call_id, body, tensors), end = run(read_all(data, 3))
    assert type(bad) is MessageError
    assert bad.call_id == 77
    assert str(bad) == message
    assert (call_id, body, list(tensors)) == (78, Health(), ["ok"])
    assert_same(tensors["ok"], good)
    assert type(end) is asyncio.IncompleteReadError and end.partial == b""  # nothing left over


@pytest.mark.parametrize(("header", "call_id"), [
    (msgspec.msgpack.encode({"call_id": 41, "body": {"type": "NoSuchMessage"}, "tensors": []}), 41),
    (msgspec.msgpack.encode({"call_id": 42, "body": {"type": "Release", "rids": "not-a-list"}}), 42),
    (msgspec.msgpack.encode({"body": {"type": "Health"}}), -1),
    (b"\xc1", -1),  # a byte msgpack never uses
], ids=["unknown_tag", "bad_field", "no_call_id", "not_msgpack"])
def test_undecodable_header_is_a_message_error_and_the_stream_stays_aligned(header, call_id):
    data = PREFIX.pack(MAGIC, len(header), 3) + header + b"xyz" + frame_bytes(9, Stats())
    bad, good, end = run(read_all(data, 3))
    assert type(bad) is MessageError
    assert bad.call_id == call_id
    assert str(bad).startswith("undecodable message header: ")
    assert good == (9, Stats(), {})
    assert type(end) is asyncio.IncompleteReadError


def test_bad_magic_is_a_frame_error():
    data = PREFIX.pack(b"SSF0", 0, 0) + frame_bytes(1, Health())
    [bad] = run(read_all(data, 1))
    assert type(bad) is FrameError
    assert bad.code == "malformed_frame"
    assert str(bad) == "bad frame magic b'SSF0' (expected b'SSF1')"


def test_frame_over_max_bytes_is_a_frame_error_and_the_limit_is_inclusive():
    frame = frame_bytes(1, Health(), {"t": torch.zeros(100, dtype=torch.uint8)})
    size = len(frame) - PREFIX.size  # header + payload, what max_bytes limits
    [bad] = run(read_all(frame, 1, max_bytes=size - 1))
    assert type(bad) is FrameError
    assert bad.code == "message_too_large"
    assert str(bad) == f"frame of {size} bytes exceeds the limit of {size - 1} bytes"
    [(call_id, body, tensors)] = run(read_all(frame, 1, max_bytes=size))
    assert (call_id, body, tuple(tensors["t"].shape)) == (1, Health(), (100,))
    # Only the prefix is needed to refuse: a huge claimed length is never read or allocated.
    [huge] = run(read_all(PREFIX.pack(MAGIC, 10, 2**62), 1))
    assert type(huge) is FrameError and huge.code == "message_too_large"


def test_truncated_frame_is_an_incomplete_read():
    frame = frame_bytes(1, Health(), {"t": torch.arange(4)})
    [first] = run(read_all(frame[:-1], 1))
    assert type(first) is asyncio.IncompleteReadError


# ---- 6. addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(("address", "parsed"), [
    ("127.0.0.1:80", ("127.0.0.1", 80)),
    (":80", ("127.0.0.1", 80)),
    ("localhost:0", ("localhost", 0)),
    ("unix:/tmp/x", ("unix", "/tmp/x")),
    ("unix:relative.sock", ("unix", "relative.sock")),
    ("[::1]:80", ("::1", 80)),
])
def test_parse_address(address, parsed):
    assert parse_address(address) == parsed


@pytest.mark.parametrize("address", ["", "127.0.0.1", "127.0.0.1:", "host:http", "host:-1", "/tmp/x", "unix:",
                                     "host:65536"])
def test_parse_address_rejects(address):
    with pytest.raises(ValueError, match="is neither host:port nor unix:/path|names no socket path"):
        parse_address(address)


# ---- 2./3. an echo server over TCP and a Unix socket ------------------------------------------




def test_remote_error_is_not_a_transport_error():
    assert not issubclass(RemoteError, TRANSPORT_ERRORS)
    assert not issubclass(UnexpectedReply, TRANSPORT_ERRORS)
    for exc in (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError, TimeoutError, FrameError,
                ReplyOutOfStep):
        assert issubclass(exc, TRANSPORT_ERRORS), exc
