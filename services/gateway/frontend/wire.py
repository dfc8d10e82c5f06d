"""The messages between a front end and the engine, and their frames (a u32 length, then msgpack).

Front end -> engine: `Submit` (a tokenized request), `Abort`, `Count` (an error the front end
answered itself, for the engine's metrics), `Query` (health, SLO classes, metrics text).
Engine -> front end: `Hello` (the SLO classes), `Events` (every request event since the last frame,
in order), `Answer` (to a `Query`).

A connection opens with the services' mutual handshake over the shared secret (shared/wire/auth.py's
messages and checks, in this framing): `AuthHello` -> `AuthChallenge` -> `AuthProof`, then `Hello`
(authenticated) or the connection is closed. Only then does the engine read anything else.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import msgspec

from specserve.shared.wire.logprobs import TokenLogprobs
from specserve.shared.wire.messages import AuthChallenge, AuthHello, AuthProof, SamplingSpec
from specserve.shared.wire.rpc import parse_address

T = TypeVar("T")
LENGTH = struct.Struct("!I")
MAX_FRAME_BYTES = 64 * 2**20
HANDSHAKE_TIMEOUT_S = 10.0  # each side of a new connection must finish the handshake within this
MAX_HANDSHAKE_BYTES = 1024  # the engine reads no larger frame before a connection is authenticated


class Submit(msgspec.Struct, tag=True, array_like=True):
    rid: str
    prompt: list[int]
    sampling: SamplingSpec
    max_tokens: int
    tier: str
    tpot_ms: float
    ttft_ms: float
    stop_ids: list[int]
    best_effort_ok: bool
    trace: bytes = b""  # the front end's request span (obs/spans.to_wire), while tracing is on
    grammar_kind: str = ""  # structured output: its GrammarSpec (engine/grammar.py), compiled again by the engine
    grammar_source: str = ""
    grammar_field: str = ""
    final_only: bool = False  # Submission.final_only


class Abort(msgspec.Struct, tag=True, array_like=True):
    rid: str
    reason: str


class Count(msgspec.Struct, tag=True, array_like=True):
    code: str  # an error code for specserve:request_errors_total


class Query(msgspec.Struct, tag=True, array_like=True):
    qid: int
    what: str  # "health", "slo_classes" or "metrics"


class Hello(msgspec.Struct, tag=True, array_like=True):
    classes: dict[str, tuple[float, float]]  # name -> (tpot_ms, ttft_ms)


ADMITTED, TOKENS, FINISHED = 0, 1, 2


class Event(msgspec.Struct, array_like=True, omit_defaults=True):
    rid: str
    kind: int  # ADMITTED, TOKENS or FINISHED
    tokens: list[int] = []
    replica: int = -1  # ADMITTED
    reason: str = ""  # FINISHED: stop, length, abort, error, rejected or invalid (a 400)
    error: str | None = None
    retry_after_s: float | None = None
    report: bytes = b""  # FINISHED: the request's `specserve` report, JSON
    logprobs: TokenLogprobs | None = None  # TOKENS: theirs, for a request that asked
    prompt_logprobs: TokenLogprobs | None = None  # TOKENS: the prompt's, in the request's first


class Events(msgspec.Struct, tag=True, array_like=True):
    items: list[Event]


class Answer(msgspec.Struct, tag=True, array_like=True):
    qid: int
    status: int
    body: bytes  # JSON (health, slo_classes) or the Prometheus text (metrics)


ToEngine = Submit | Abort | Count | Query
ToFrontend = Hello | Events | Answer

_encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytes:
    """One message (a link message, or one of shared/wire/auth.py's during the handshake) as a frame."""
    body = _encoder.encode(message)
    return LENGTH.pack(len(body)) + body


async def read(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[T],
               max_bytes: int = MAX_FRAME_BYTES) -> T:
    """The next message; asyncio.IncompleteReadError at the end of the stream."""
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if n > max_bytes:
        raise ConnectionError(f"a frame of {n} bytes (at most {max_bytes})")
    return decoder.decode(await reader.readexactly(n))


to_engine: msgspec.msgpack.Decoder[ToEngine] = msgspec.msgpack.Decoder(ToEngine)
to_frontend: msgspec.msgpack.Decoder[ToFrontend] = msgspec.msgpack.Decoder(ToFrontend)
auth_hello = msgspec.msgpack.Decoder(AuthHello)
auth_challenge = msgspec.msgpack.Decoder(AuthChallenge)
auth_proof = msgspec.msgpack.Decoder(AuthProof)


async def open_link(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to an engine's link: "unix:/path" or "host:port" (shared/wire/rpc.py's address forms)."""
    host, port = parse_address(address)
    if host == "unix":
        return await asyncio.open_unix_connection(cast(str, port))
    return await asyncio.open_connection(host, port)


async def serve_link(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                     address: str) -> asyncio.Server:
    """The engine's side: serve `handler` on "unix:/path" or "host:port" (port 0: any free)."""
    host, port = parse_address(address)
    if host == "unix":
        return await asyncio.start_unix_server(handler, path=cast(str, port))
    return await asyncio.start_server(handler, host, port)
