"""An authenticated connection as a raw stream: the handshake done frame by frame, then bytes by hand."""

from __future__ import annotations

import asyncio
from typing import cast

from specserve.shared.wire.auth import ClientHandshake, load_secret
from specserve.shared.wire.messages import AuthChallenge, AuthOk
from specserve.shared.wire.rpc import parse_address
from specserve.shared.wire.transport import read_frame, write_frame


async def raw_link(address: str, secret: str | bytes | None = None) -> tuple[asyncio.StreamReader,
                                                                              asyncio.StreamWriter]:
    """Open `address` ("host:port" or "unix:/path"), authenticate with the shared secret, and return the
    stream, so that a test can write frames (or anything else) by hand and read the replies."""
    host, port = parse_address(address)
    if host == "unix":
        reader, writer = await asyncio.open_unix_connection(cast(str, port), limit=2**20)
    else:
        reader, writer = await asyncio.open_connection(host, port, limit=2**20)
    handshake = ClientHandshake(load_secret(secret))
    await write_frame(writer, 1, handshake.hello())
    _, challenge, _ = await read_frame(reader)
    assert isinstance(challenge, AuthChallenge), challenge
    await write_frame(writer, 2, handshake.prove(challenge))
    _, ok, _ = await read_frame(reader)
    assert isinstance(ok, AuthOk), ok
    return reader, writer
