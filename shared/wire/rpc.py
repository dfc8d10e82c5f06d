"""Request/reply over frames: an asyncio server that keeps serving through bad input, and a client.

Addresses are "host:port" for TCP or "unix:/path" for a Unix socket. On one connection calls are
answered in order, one at a time; the handler itself decides what may run concurrently across
connections (the services serialize model work with one lock).

Every connection is authenticated first (shared/wire/auth.py): `RpcClient.connect` runs the handshake
with the shared secret, and until it is done `RpcServer` answers `Health` only; anything else gets
`Error("unauthenticated")`, and a wrong proof, or a few such calls, close the connection. An
unauthenticated connection is also limited in frame size (`UNAUTHENTICATED_MAX_FRAME_BYTES`), in
lifetime (`handshake_timeout_s`) and in number (the oldest beyond `MAX_UNAUTHENTICATED` is dropped).
On any connection, a frame whose prefix arrived must be complete within `frame_timeout_s`.
Authenticated connections may stay idle as long as they like.

Error handling, per connection:
- a frame whose content cannot be decoded gets an Error reply, and the connection stays open;
- a frame that cannot be trusted (bad magic, over the size limit, stalled past `frame_timeout_s`)
  gets an Error reply and the connection is closed, since the byte stream cannot be resynchronized;
- a client that disconnects mid-call is noticed when the reply cannot be written; the call's work
  is complete and consistent (the engines are atomic per call) and nothing else is affected.

What a failed RpcClient.call means to its caller:
- TRANSPORT_ERRORS (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError, FrameError,
  ReplyOutOfStep): the peer or the connection is gone, or the reply stream can no longer be trusted
  (an unreadable frame, a reply to another call). Drop this client and reconnect. AuthError (a
  ConnectionError) from `connect`: the handshake failed (a different secret at the other end).
- RemoteError: the peer is alive and answered this call with an Error (it refused or failed that
  call); the connection stays in step and usable.
- UnexpectedReply: the peer answered in step but with another message type than the call expects
  (a different or mismatched service, or a bug). Like ReplyOutOfStep it is an RpcProtocolError;
  unlike it, it is not a transport error, since the connection is still in step.
- MessageError (transport.py): the reply frame was read whole but its content could not be decoded;
  the connection is still in step.
All of RemoteError and RpcProtocolError are RuntimeErrors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec
import torch

from specserve.shared.process import tracing
from specserve.shared.process.ports import port_in_use_as_error
from specserve.shared.wire.auth import AuthError, ClientHandshake, ServerHandshake, load_secret
from specserve.shared.wire.messages import AuthChallenge, AuthHello, AuthOk, AuthProof, Error, Health, Message
from specserve.shared.wire.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    PREFIX,
    FrameError,
    MessageError,
    Tensors,
    decode_frame,
    encode_frame,
    frame_lengths,
    read_traced_frame,
    write_buffers,
    write_frame,
)

if TYPE_CHECKING:
    from specserve.shared.wire.cuda_ipc import CudaIpc

log = logging.getLogger(__name__)

DEFAULT_FRAME_TIMEOUT_S = 10.0  # a frame's header and payload must follow its prefix within this
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated connection is dropped after this
UNAUTHENTICATED_MAX_FRAME_BYTES = 64 * 1024  # the largest frame read before the handshake is done
MAX_UNAUTHENTICATED = 32  # unauthenticated connections at once; a new one drops the oldest
CLOSE_TIMEOUT_S = 1.0  # a closing connection's last bytes get this long to drain, then it is aborted

Handler = Callable[[Message, dict[str, torch.Tensor]], Awaitable[tuple[Message, Tensors | None]]]
ReplyT = TypeVar("ReplyT", bound=msgspec.Struct)


class RemoteError(RuntimeError):
    """The service answered a call with an Error: it is alive and refused or failed that call."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RpcProtocolError(RuntimeError):
    """A reply that does not belong to the call it answers."""


class ReplyOutOfStep(RpcProtocolError):
    """The reply carries another call's id: the stream is out of step (a transport error)."""

    def __init__(self, call_id: int, reply_id: int):
        super().__init__(f"reply to call {reply_id} arrived for call {call_id}")
        self.call_id = call_id
        self.reply_id = reply_id


class UnexpectedReply(RpcProtocolError):
    """The service answered in step, but with another message type than the call expects."""

    def __init__(self, call: Message, expected: type, reply: Message):
        super().__init__(f"{type(call).__name__} expects a {expected.__name__} reply, "
                         f"the service answered {type(reply).__name__}")
        self.expected = expected
        self.reply = reply


# The peer or the connection is gone, or the reply stream cannot be trusted: reconnect. (ConnectionError
# and TimeoutError are OSErrors; they are listed for the reader.) RemoteError is not among them.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    ConnectionError,
    OSError,
    asyncio.IncompleteReadError,
    TimeoutError,
    FrameError,
    ReplyOutOfStep,
)


def parse_address(address: str) -> tuple[str, str | int]:
    """("unix", path) or (host, port)."""
    if address.startswith("unix:"):
        if len(address) == len("unix:"):
            raise ValueError("address 'unix:' names no socket path")
        return "unix", address[len("unix:") :]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} is neither host:port nor unix:/path")
    return host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port)


def _ipc(enabled: bool) -> CudaIpc | None:
    if not enabled:
        return None
    from specserve.shared.wire.cuda_ipc import CudaIpc

    return CudaIpc()


class RpcServer:
    """Serves `handler` to authenticated connections (and Health to any).

    secret: the shared secret (default: shared/wire/auth.py's lookup; none is a SettingsError).
    frame_timeout_s, handshake_timeout_s: see the module docstring.
    cuda_ipc: accept and send CUDA tensors as IPC handles (peers on the same GPU host only; only
    once a connection is authenticated)."""

    def __init__(self, handler: Handler, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, cuda_ipc: bool = False, *,
                 secret: str | bytes | None = None, frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
                 handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S):
        self.handler = handler
        self.max_frame_bytes = max_frame_bytes
        self.cuda_ipc = cuda_ipc
        self.secret = load_secret(secret)
        self.frame_timeout_s = frame_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._server: asyncio.AbstractServer | None = None
        self._socket_path: str | None = None  # the Unix socket this server made; removed by close()
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._unauthenticated: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # oldest first

    async def start(self, address: str) -> str:
        """Listen; return the bound address (with the real port when port 0 was asked for).
        A TCP port that is taken raises ports.PortInUse. A Unix socket path replaces a stale file
        there, and close() removes it."""
        host, port = parse_address(address)
        if host == "unix":
            path = cast(str, port)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._server = await asyncio.start_unix_server(self._serve, path=path, limit=2**20)
            self._socket_path = path
            return address
        with port_in_use_as_error(cast(int, port)):
            self._server = await asyncio.start_server(self._serve, host, port, limit=2**20)
        bound = self._server.sockets[0].getsockname()
        return f"{bound[0]}:{bound[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._connections.values():
                writer.transport.abort()  # each connection's loop then ends on its own
            if self._connections:
                await asyncio.wait(list(self._connections), timeout=5)
            await self._server.wait_closed()
        if self._socket_path is not None:  # no socket file is left behind (Python 3.13 would do it itself)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket_path)
            self._socket_path = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = cast("asyncio.Task[None]", asyncio.current_task())  # never None inside a connection's task
        self._connections[task] = writer
        self._unauthenticated[task] = writer
        if len(self._unauthenticated) > MAX_UNAUTHENTICATED:
            oldest = next(iter(self._unauthenticated))
            self._unauthenticated.pop(oldest).transport.abort()
        try:
            await self._loop(reader, writer, task)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; its completed calls stand, nothing else is touched
        except TimeoutError:
            log.info("dropped a connection from %s: not authenticated within %g s",
                     writer.get_extra_info("peername"), self.handshake_timeout_s)
        finally:
            self._connections.pop(task, None)
            self._unauthenticated.pop(task, None)
            writer.close()
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):  # a peer that reads nothing cannot hold it open
                    await writer.wait_closed()
            except Exception:
                writer.transport.abort()

    async def _loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    task: asyncio.Task[None]) -> None:
        ipc = _ipc(self.cuda_ipc)  # one per connection: it keeps the last reply's tensors alive
        gate = ServerHandshake(self.secret)
        async with asyncio.timeout(self.handshake_timeout_s) as deadline:  # lifted once authenticated
            while True:
                trusted = gate.authenticated
                try:
                    call_id, body, tensors, trace = await read_traced_frame(
                        reader, self.max_frame_bytes if trusted else min(self.max_frame_bytes,
                                                                         UNAUTHENTICATED_MAX_FRAME_BYTES),
                        ipc if trusted else None, self.frame_timeout_s)
                except asyncio.IncompleteReadError:
                    return
                except FrameError as exc:
                    await write_frame(writer, -1, Error(exc.code, str(exc)))
                    return
                except MessageError as exc:
                    await write_frame(writer, exc.call_id, Error("bad_message", str(exc)))
                    continue
                out: Tensors | None = None
                if isinstance(body, (AuthHello, AuthProof)) or not (trusted or isinstance(body, Health)):
                    reply = gate.answer(body)
                    if gate.authenticated and not trusted:
                        deadline.reschedule(None)
                        self._unauthenticated.pop(task, None)
                else:
                    reply, out = await self._call(call_id, body, tensors, trace)
                if ipc is not None:
                    ipc.new_frame()
                try:
                    frame = encode_frame(call_id, reply, out, ipc)
                except Exception as exc:  # an unencodable reply must not take the connection down
                    log.exception("call %d (%s): the reply could not be encoded", call_id, type(body).__name__)
                    frame = encode_frame(call_id, Error("internal", f"unencodable reply: {type(exc).__name__}: {exc}"))
                write_buffers(writer, frame)
                await writer.drain()
                if gate.refused:
                    return

    async def _call(self, call_id: int, body: Message, tensors: dict[str, torch.Tensor],
                    trace: dict[str, str] | None = None) -> tuple[Message, Tensors | None]:
        if trace is not None and tracing.ENABLED:
            with tracing.server_call(type(body).__name__, trace, body) as span:
                reply, out = await self._run(call_id, body, tensors)
                if span is not None and span.is_recording():
                    span.set_attributes(tracing.struct_attributes("specserve.reply", reply))
                    if isinstance(reply, Error):
                        tracing.failed(span, f"{reply.code}: {reply.message}")
                return reply, out
        return await self._run(call_id, body, tensors)

    async def _run(self, call_id: int, body: Message,
                   tensors: dict[str, torch.Tensor]) -> tuple[Message, Tensors | None]:
        try:
            return await self.handler(body, tensors)
        except Exception as exc:  # a bug in one call must not take the service down
            log.exception("call %d (%s) failed", call_id, type(body).__name__)
            return Error("internal", f"{type(exc).__name__}: {exc}"), None


class _Replies(asyncio.Protocol):
    """The client's end of a connection: each frame is decoded as soon as its last byte arrives and
    handed to the call that waits for it (replies come in call order), in the event loop's callback
    itself, so the caller resumes one turn of the loop after the bytes arrive."""

    def __init__(self, max_frame_bytes: int, ipc: CudaIpc | None):
        self.max_frame_bytes = max_frame_bytes
        self.ipc = ipc
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiting: collections.deque[tuple[asyncio.Future[Any], Callable[[], None]]] = collections.deque()
        self.error: BaseException | None = None  # why no further call can be made on this connection
        self.lost = asyncio.get_running_loop().create_future()  # done once the connection is closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def expect(self, done: Callable[[], None]) -> asyncio.Future[Any]:
        """A future for the next reply; `done` is called when that reply (or the connection's end) arrives,
        whether or not anyone still waits for it."""
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((future, done))
        return future

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while len(buffer) >= PREFIX.size:
            try:
                header_len, payload_len = frame_lengths(buffer, self.max_frame_bytes)
            except FrameError as exc:
                self._fail(exc)
                return
            end = PREFIX.size + header_len + payload_len
            if len(buffer) < end:
                return
            header = bytes(buffer[PREFIX.size : PREFIX.size + header_len])
            payload = buffer[PREFIX.size + header_len : end] if payload_len else bytearray()
            del buffer[:end]
            if not self.waiting:
                self._fail(FrameError("unexpected_frame", "the service sent a frame that answers no call"))
                return
            future, done = self.waiting.popleft()
            done()
            if future.done():  # its caller gave up (a timeout): the reply is read, the stream stays in step
                continue
            try:
                future.set_result(decode_frame(header, payload, self.ipc)[:3])
            except Exception as exc:  # MessageError, or a bug: the frame was read whole, the stream is in step
                future.set_exception(exc)

    def eof_received(self) -> bool:
        self._fail(asyncio.IncompleteReadError(bytes(self.buffer), None))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc if exc is not None else ConnectionResetError("the connection was closed"))
        if not self.lost.done():
            self.lost.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        """The connection is unusable: every waiting call gets `exc`, later calls too; it is closed."""
        if self.error is None:
            self.error = exc
        while self.waiting:
            future, done = self.waiting.popleft()
            done()
            if not future.done():
                future.set_exception(self.error)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


class RpcClient:
    """One connection; call() sends a message and waits for its reply (one call at a time)."""

    def __init__(self, transport: asyncio.Transport, replies: _Replies, address: str):
        self.transport, self.replies, self.address = transport, replies, address
        self.ipc = replies.ipc
        self._next_id = 0
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                      cuda_ipc: bool = False, secret: str | bytes | None = None) -> RpcClient:
        """Connect and authenticate with the shared secret (default: shared/wire/auth.py's lookup).
        Raises SettingsError if there is no secret, AuthError if the handshake fails."""
        key = load_secret(secret)
        loop = asyncio.get_running_loop()
        host, port = parse_address(address)
        ipc = _ipc(cuda_ipc)
        if host == "unix":
            transport, replies = await loop.create_unix_connection(lambda: _Replies(max_frame_bytes, ipc),
                                                                   cast(str, port))
        else:
            transport, replies = await loop.create_connection(lambda: _Replies(max_frame_bytes, ipc), host,
                                                              cast(int, port))
        client = cls(transport, replies, address)
        try:
            await client._authenticate(key)
        except BaseException:
            await client.close()
            raise
        return client

    @classmethod
    async def attach(cls, sock: socket.socket, address: str,
                     max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> RpcClient:
        """A client on a connected socket, with no handshake (for a peer that has none, as in tests)."""
        transport, replies = await asyncio.get_running_loop().create_connection(
            lambda: _Replies(max_frame_bytes, None), sock=sock)
        return cls(transport, replies, address)

    async def _authenticate(self, secret: bytes) -> None:
        handshake = ClientHandshake(secret)
        try:
            challenge, _ = await self.call(handshake.hello(), AuthChallenge)
            await self.call(handshake.prove(challenge), AuthOk)
        except AuthError as exc:
            raise AuthError(f"{self.address}: {exc}") from None
        except (RemoteError, RpcProtocolError) as exc:
            raise AuthError(f"the service at {self.address} refused the handshake ({exc}); is the secret "
                            "the same at both ends?") from None

    def _send(self, body: Message, tensors: Tensors | None) -> int:
        """Write the call's frame now (the lock is held); returns its call id."""
        if self.replies.error is not None:
            raise self.replies.error
        self._next_id += 1
        call_id = self._next_id
        if self.ipc is not None:
            self.ipc.new_frame()
        trace = tracing.carrier() if tracing.ENABLED else None  # the caller's span, when tracing is on
        write_buffers(self.transport, encode_frame(call_id, body, tensors, self.ipc, trace))
        return call_id

    async def call(self, body: Message, reply_type: type[ReplyT],
                   tensors: Tensors | None = None) -> tuple[ReplyT, dict[str, torch.Tensor]]:
        """Send `body` and return its reply, which must be a `reply_type`, and the reply's tensors.

        Raises RemoteError if the service answered Error, UnexpectedReply if it answered another
        message type, and one of TRANSPORT_ERRORS if the connection failed (see the module docstring).
        A caller that is cancelled (a timeout) does not cancel the round trip: its reply is still read
        (and dropped) when it comes, so the connection stays in step for the next call, which is sent
        only then.

        The frame is written in the caller's own turn of the event loop (when no other call holds
        the connection, taking the lock does not yield), so a Forward leaves before any other ready
        task runs; the reply is decoded in the protocol's callback as its bytes arrive.
        """
        if not (isinstance(reply_type, type) and issubclass(reply_type, msgspec.Struct)):
            raise TypeError(f"call(body, reply_type, tensors): reply_type must be a message class, "
                            f"not {reply_type!r}")
        await self._lock.acquire()  # held until this call's reply has arrived (the protocol releases it)
        try:
            call_id = self._send(body, tensors)
        except BaseException:
            self._lock.release()
            raise
        reply_id, reply, out = await self.replies.expect(self._lock.release)
        if reply_id not in (call_id, -1):
            raise ReplyOutOfStep(call_id, reply_id)
        if isinstance(reply, Error):
            raise RemoteError(reply.code, reply.message)
        if not isinstance(reply, reply_type):
            raise UnexpectedReply(body, reply_type, reply)
        return reply, out

    @property
    def alive(self) -> bool:
        """The connection is open at both ends as far as this process knows now: the peer has not
        closed it (a killed service's socket is closed by its kernel, and the event loop sees the EOF
        at once, with no call in flight) and no error or close happened on our side."""
        return self.replies.error is None and not self.transport.is_closing()

    async def close(self) -> None:
        self.transport.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.shield(self.replies.lost)
        if not self.replies.lost.done():
            self.transport.abort()
