"""Strangers cannot drive the services: the shared-secret handshake and the server-side timeouts.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_auth.py.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time

import pytest
import torch

from specserve.shared.wire.auth import AuthError, ClientHandshake, load_secret
from specserve.shared.wire.messages import (
    AuthChallenge,
    AuthHello,
    AuthOk,
    AuthProof,
    Error,
    Forward,
    Health,
    HealthReply,
    Message,
    Offload,
    PrefillEntry,
    Release,
    SamplingSpec,
    Speculate,
    SpeculateEntry,
    Stats,
)
from specserve.shared.wire.rpc import RpcClient, RpcServer
from specserve.shared.wire.service_client import DraftClient, PrefillItem, SpeculateItem, TargetClient
from specserve.shared.wire.transport import MAGIC, PREFIX, frame_bytes, read_frame
from tests.support import poll
from tests.support.drive import Req, drive
from tests.support.fixtures import start_services
from tests.support.raw_link import raw_link

FRAME_TIMEOUT_S = 1.0
HANDSHAKE_TIMEOUT_S = 2.0
PROMPT = list(range(5, 37))


@pytest.fixture(scope="module")
def services(request):
    """A target and a draft with short timeouts (set through the environment, which they inherit)."""
    saved = dict(os.environ)
    for kind in ("TARGET", "DRAFT"):
        os.environ[f"SPECSERVE_{kind}_FRAME_TIMEOUT_S"] = str(FRAME_TIMEOUT_S)
        os.environ[f"SPECSERVE_{kind}_HANDSHAKE_TIMEOUT_S"] = str(HANDSHAKE_TIMEOUT_S)
    try:
        pair = start_services(request, "--kv-blocks", "64")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return pair._asdict()


def _run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _open(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, call_id: int, body: Message,
                tensors: dict[str, torch.Tensor] | None = None) -> Message:
    writer.write(frame_bytes(call_id, body, tensors))
    await writer.drain()
    reply_id, reply, _ = await asyncio.wait_for(read_frame(reader), 10)
    assert reply_id == call_id
    return reply


async def _closed_after(reader: asyncio.StreamReader, limit_s: float = 10.0) -> float:
    """Seconds until the server closes the connection (EOF; anything else it sends is skipped)."""
    t0 = time.monotonic()
    async with asyncio.timeout(limit_s):
        while await reader.read(1 << 16):
            pass
    return time.monotonic() - t0


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _stranger_calls(kind: str) -> list[tuple[Message, dict[str, torch.Tensor] | None]]:
    if kind == "target":
        return [(Release(["mine"]), None),
                (Forward([PrefillEntry("theirs", 1, 0, len(PROMPT), True, SamplingSpec())]),
                 {"prefill_tokens": _ints(PROMPT)}),
                (Stats(), None)]
    return [(Release(["mine"]), None), (Offload(), None),
            (Speculate([SpeculateEntry("theirs", 1, len(PROMPT), len(PROMPT), 2, 2)]), {"tokens": _ints(PROMPT)})]


async def _own_request(kind: str, address: str) -> DraftClient | TargetClient:
    """An authenticated client holding one request, "mine"."""
    if kind == "target":
        tc = await TargetClient.connect(address)
        outs, _ = await tc.forward([PrefillItem("mine", 1, 0, PROMPT, True, SamplingSpec())])
        assert outs[0].error is None
        return tc
    dc = await DraftClient.connect(address)
    cands, _ = await dc.speculate([SpeculateItem("mine", 1, PROMPT, len(PROMPT), 2, 2)])
    assert cands[0].error is None
    return dc


# ---- who may do what ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_health_answers_without_the_secret(services, kind):
    async def main():
        reader, writer = await _open(services[kind].address)
        reply = await _call(reader, writer, 7, Health())
        writer.close()
        return reply

    reply = _run(main())
    assert isinstance(reply, HealthReply) and reply.service == kind and reply.status == "ok"


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_a_stranger_cannot_release_offload_or_create_requests(services, kind):
    """No handshake: each call is refused as unauthenticated, the third closes the connection, and
    the service's state (read by an authenticated client) is exactly as before."""

    async def main():
        own = await _own_request(kind, services[kind].address)
        before = await own.stats()
        reader, writer = await _open(services[kind].address)
        replies = [await _call(reader, writer, i, body, tensors)
                   for i, (body, tensors) in enumerate(_stranger_calls(kind), 1)]
        closed_s = await _closed_after(reader)
        after = await own.stats()
        health = await own.health()
        assert (await own.release(["mine", "theirs"])).released == ["mine"]
        await own.close()
        return replies, closed_s, before, after, health

    replies, closed_s, before, after, health = _run(main())
    assert [type(r) for r in replies] == [Error] * 3, replies
    assert all(r.code == "unauthenticated" for r in replies), replies
    assert closed_s < 1.0  # closed right after the third refusal, not by a timeout
    assert after == before and before.resident_requests == 1 and not after.offloaded
    assert health.status == "ok"  # the draft was not offloaded


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_a_wrong_proof_a_replayed_proof_and_a_reflected_proof_are_refused(services, kind):
    address = services[kind].address
    secret = load_secret()

    async def refused_after(prove) -> tuple[Message, float]:
        reader, writer = await _open(address)
        challenge = await _call(reader, writer, 1, AuthHello(secrets.token_bytes(32)))
        assert isinstance(challenge, AuthChallenge)
        reply = await _call(reader, writer, 2, AuthProof(prove(challenge)))
        return reply, await _closed_after(reader)

    async def main():
        own = await _own_request(kind, address)
        before = await own.stats()
        wrong = await refused_after(lambda _c: secrets.token_bytes(32))
        reflected = await refused_after(lambda c: c.proof)  # the server's own proof sent back
        # A proof that was good once, replayed on a new connection with the same client nonce:
        handshake = ClientHandshake(secret)
        reader, writer = await _open(address)
        challenge = await _call(reader, writer, 1, handshake.hello())
        proof = handshake.prove(challenge)
        assert isinstance(await _call(reader, writer, 2, proof), AuthOk)
        writer.close()
        reader, writer = await _open(address)
        assert isinstance(await _call(reader, writer, 1, handshake.hello()), AuthChallenge)
        replayed = await _call(reader, writer, 2, proof), await _closed_after(reader)
        # Proof before any challenge:
        reader, writer = await _open(address)
        unasked = await _call(reader, writer, 1, AuthProof(proof.proof)), await _closed_after(reader)
        # A client with a wrong secret finds out from the server's proof and never proves anything.
        with pytest.raises(AuthError, match="does not hold our shared secret"):
            await RpcClient.connect(address, secret="not-the-secret-of-these-services")
        after = await own.stats()
        await own.release(["mine"])
        await own.close()
        return [wrong, reflected, replayed, unasked], before, after

    outcomes, before, after = _run(main())
    for reply, closed_s in outcomes:
        assert isinstance(reply, Error) and reply.code == "unauthenticated", reply
        assert closed_s < 1.0
    assert after == before


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_an_authenticated_client_is_served_and_may_stay_idle(services, kind):
    """An authenticated client that sends nothing outlasts both timeouts and is then served. The
    timeouts are seen to run out while it is idle: a silent unauthenticated connection opened after it
    is dropped (handshake timeout), and an authenticated one that sends only a frame's prefix gets
    frame_timeout."""
    address = services[kind].address

    async def main():
        client = await RpcClient.connect(address)  # idle from here on
        silent, _ = await _open(address)
        half_reader, half = await raw_link(address)
        half.write(PREFIX.pack(MAGIC, 16, 1000))
        await half.drain()
        (_, expired, _), _ = await asyncio.gather(asyncio.wait_for(read_frame(half_reader), 10),
                                                  _closed_after(silent))
        half.close()
        reply = await client.call(Health(), HealthReply)
        await client.close()
        return expired, reply

    expired, (health, _) = _run(main())
    assert isinstance(expired, Error) and expired.code == "frame_timeout", expired
    assert health.service == kind


def test_the_gateways_clients_drive_both_services(services):
    """DraftClient / TargetClient.connect(address), as the gateway calls them: speculative steps run."""

    async def main():
        dc = await DraftClient.connect(services["draft"].address)
        tc = await TargetClient.connect(services["target"].address)
        out = await drive(dc, tc, [Req("ok", PROMPT, 6)], stop_ids=set())
        stats = await tc.stats(), await dc.stats()
        await dc.close()
        await tc.close()
        return out, stats

    out, (target_stats, draft_stats) = _run(main())
    assert len(out["ok"]) == 6
    assert target_stats.resident_requests == 0 and draft_stats.resident_requests == 0


# ---- timeouts ----------------------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise LookupError("VmRSS")


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_a_half_sent_frame_is_dropped_after_the_frame_timeout(services, kind):
    """An authenticated client sends a prefix promising 200 MiB and 64 MiB of it, then nothing: the
    service answers frame_timeout after --frame-timeout-s, closes the connection and frees the bytes."""
    service = services[kind]

    async def main():
        reader, writer = await raw_link(service.address)
        base = _rss_mib(service.proc.pid)
        t0 = time.monotonic()  # the frame's clock starts when its prefix arrives, before the 64 MiB are in
        writer.write(PREFIX.pack(MAGIC, 64, 200 << 20) + bytes(64 + (64 << 20)))
        await writer.drain()
        reply_id, reply, _ = await asyncio.wait_for(read_frame(reader), 10)
        closed_s = time.monotonic() - t0 + await _closed_after(reader)
        return reply_id, reply, closed_s, base

    reply_id, reply, closed_s, base = _run(main())
    assert reply_id == -1 and isinstance(reply, Error) and reply.code == "frame_timeout", reply
    assert FRAME_TIMEOUT_S * 0.8 < closed_s < FRAME_TIMEOUT_S + 3
    # the 64 MiB buffered are given back: a kept buffer would show +64; the allocator may keep some
    poll.until(lambda: _rss_mib(service.proc.pid), 10, f"the service's RSS back under {base:.0f} + 32 MiB",
               ok=lambda rss: rss < base + 32)
    assert service.alive()


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_before_the_handshake_frames_are_small_and_must_not_stall(services, kind):
    """Unauthenticated: a prefix promising 200 MiB is refused at once; one promising 1000 bytes that
    never come is dropped after the frame timeout."""
    address = services[kind].address

    async def main():
        out = []
        for payload in (200 << 20, 1000):
            reader, writer = await _open(address)
            writer.write(PREFIX.pack(MAGIC, 16, payload))
            await writer.drain()
            t0 = time.monotonic()
            _, reply, _ = await asyncio.wait_for(read_frame(reader), 10)
            out.append((reply, time.monotonic() - t0 + await _closed_after(reader)))
        return out

    (big, big_s), (stalled, stalled_s) = _run(main())
    assert isinstance(big, Error) and big.code == "message_too_large" and big_s < 1.0, big
    assert isinstance(stalled, Error) and stalled.code == "frame_timeout", stalled
    assert FRAME_TIMEOUT_S * 0.8 < stalled_s < FRAME_TIMEOUT_S + 3


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_an_unauthenticated_connection_is_dropped_after_the_handshake_timeout(services, kind):
    """Idle, or asking for Health forever: either way it goes after --handshake-timeout-s."""
    address = services[kind].address

    async def main():
        reader, writer = await _open(address)
        idle_s = await _closed_after(reader)
        reader, writer = await _open(address)
        t0, healthy = time.monotonic(), 0
        try:
            while True:
                assert isinstance(await _call(reader, writer, healthy + 1, Health()), HealthReply)
                healthy += 1
                await asyncio.sleep(0.25)  # its pace: a Health every quarter second (the scenario, not a wait)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        return idle_s, healthy, time.monotonic() - t0

    idle_s, healthy, chatty_s = _run(main())
    assert HANDSHAKE_TIMEOUT_S * 0.8 < idle_s < HANDSHAKE_TIMEOUT_S + 3
    assert healthy >= 3 and HANDSHAKE_TIMEOUT_S * 0.8 < chatty_s < HANDSHAKE_TIMEOUT_S + 3


# ---- starting without a secret, and where the secret comes from ---------------------------------


def test_a_service_without_a_secret_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k not in ("SPECSERVE_SECRET", "SPECSERVE_SECRET_FILE")}
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "target", "--port", "0", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, (out, err)
    assert err.startswith("error: no shared secret: set SPECSERVE_SECRET_FILE") and err.count("\n") == 1, err
    assert "ready" not in out


# ---- in-process: the cap on unauthenticated connections --------------------------------------


async def _health_only(body, tensors):
    return HealthReply("test", "ok", "none", "cpu", "float32", 0.0), None


def test_beyond_the_cap_a_new_unauthenticated_connection_drops_the_oldest():
    from specserve.shared.wire.rpc import MAX_UNAUTHENTICATED

    async def main():
        server = RpcServer(_health_only, handshake_timeout_s=60)
        address = await server.start("127.0.0.1:0")
        conns = [await _open(address) for _ in range(MAX_UNAUTHENTICATED)]
        for reader, writer in conns:  # each one accepted and served
            assert isinstance(await _call(reader, writer, 1, Health()), HealthReply)
        newest = await _open(address)
        oldest_closed_s = await _closed_after(conns[0][0], 5)
        assert isinstance(await _call(*newest, 1, Health()), HealthReply)
        assert isinstance(await _call(*conns[1], 2, Health()), HealthReply)  # the second oldest stays
        client = await RpcClient.connect(address)  # it is a new connection too: it drops the next oldest
        reply, _ = await client.call(Health(), HealthReply)
        await client.close()
        for _, writer in [*conns, newest]:
            writer.close()
        await server.close()
        return oldest_closed_s, reply

    oldest_closed_s, reply = _run(main())
    assert oldest_closed_s < 1.0 and reply.service == "test"
