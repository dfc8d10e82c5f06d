"""The draft and target services as real processes on localhost, driven over the socket transport.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_services.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from specserve.cli.main import BUNDLED_TARGET
from specserve.shared.runtime.generate import generate
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.wire.messages import Error, Forward, Health, HealthReply, PrefillEntry, SamplingSpec
from specserve.shared.wire.service_client import DraftClient, PrefillItem, SpeculateItem, TargetClient, VerifyItem
from specserve.shared.wire.transport import MAGIC, PREFIX, frame_bytes, read_frame
from tests.support import poll
from tests.support.drive import Req, drive
from tests.support.fixtures import start_services
from tests.support.raw_link import raw_link

WORKLOADS = Path(__file__).resolve().parents[2] / "bench" / "workloads"
MAX_NEW = 40


@pytest.fixture(scope="module")
def services(request):
    target, draft = start_services(request, "--kv-blocks", "512")
    yield draft, target
    assert draft.alive() and target.alive(), "a service died during the tests"
    assert draft.stop() == 0 and target.stop() == 0  # SIGTERM stops both cleanly


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tok = Tokenizer.from_file(str(BUNDLED_TARGET / "tokenizer.json"))
    out = {}
    for category, count in (("short", 4), ("medium", 1)):
        with open(WORKLOADS / f"{category}.jsonl") as f:
            for line in list(f)[:count]:
                record = json.loads(line)
                out[record["id"]] = tok.encode(record["prompt"], add_special_tokens=False).ids
    out["tiny"] = tok.encode("import os\n", add_special_tokens=False).ids
    return out


@pytest.fixture(scope="module")
def reference(prompts) -> dict[str, list[int]]:
    config = ModelConfig.from_dir(BUNDLED_TARGET)
    runner = ModelRunner.from_dir(BUNDLED_TARGET, num_blocks=512)
    return generate(runner, prompts, MAX_NEW, stop_ids=set(config.eos_token_ids))


def _run(coro):
    return asyncio.run(coro)


async def _clients(services) -> tuple[DraftClient, TargetClient]:
    draft, target = services
    return await DraftClient.connect(draft.address), await TargetClient.connect(target.address)


def _requests(prompts, tag: str) -> list[Req]:
    # Staggered joins: later requests prefill (in 64-token chunks) while earlier ones decode.
    return [Req(f"{tag}-{rid}", toks, MAX_NEW, join_step=i) for i, (rid, toks) in enumerate(prompts.items())]


async def _assert_pools_empty(dc: DraftClient, tc: TargetClient) -> None:
    for stats in (await dc.stats(), await tc.stats()):
        assert stats.free_blocks == stats.total_blocks, stats
        assert stats.resident_requests == 0, stats


def test_speculative_steps_equal_target_only_greedy(services, prompts, reference):
    async def main():
        dc, tc = await _clients(services)
        reqs = _requests(prompts, "lossless")
        eos = set(ModelConfig.from_dir(BUNDLED_TARGET).eos_token_ids)
        outputs = await drive(dc, tc, reqs, eos)
        await _assert_pools_empty(dc, tc)
        return reqs, outputs

    reqs, outputs = _run(main())
    for rid, expected in reference.items():
        assert outputs[f"lossless-{rid}"] == expected, rid
    accepted = [a for r in reqs for a in r.accepted]
    assert sum(accepted) > len(accepted) // 2, "the draft should get tokens accepted on its own demo pair"


def test_offload_and_reload_mid_generation_change_no_token(services, prompts, reference):
    transitions = []

    async def main():
        dc, tc = await _clients(services)

        async def hook(step: int) -> None:
            if step == 6:
                transitions.append(await dc.offload())
                assert (await dc.health()).status == "offloaded"
                assert (await dc.stats()).total_blocks == 0
            if step == 10:
                transitions.append(await dc.reload())
                assert (await dc.health()).status == "ok"

        reqs = _requests(prompts, "offload")
        eos = set(ModelConfig.from_dir(BUNDLED_TARGET).eos_token_ids)
        outputs = await drive(dc, tc, reqs, eos, hook=hook)
        await _assert_pools_empty(dc, tc)
        return outputs

    outputs = _run(main())
    for rid, expected in reference.items():
        assert outputs[f"offload-{rid}"] == expected, rid
    offload, reload = transitions
    assert offload.offloaded and not reload.offloaded
    assert offload.seconds > 0 and reload.seconds > 0
    assert offload.weight_bytes == reload.weight_bytes > 1_000_000  # the demo draft: 1.19M float32 weights
    assert offload.cold_requests > 0


def test_reload_rebuilds_the_draft_kv_from_committed_tokens(services, prompts):
    """After offload -> reload the draft proposes exactly the tree it proposed before: its KV was
    rebuilt from the request's token history, not left stale or empty."""
    prompt = prompts[next(k for k in prompts if k.startswith("medium"))]

    async def main():
        dc, _ = await _clients(services)
        (before,), _ = await dc.speculate([SpeculateItem("rebuild", 1, prompt, len(prompt), 4, 3)])
        await dc.offload()
        (off,), reply = await dc.speculate([SpeculateItem("rebuild", 2, [], len(prompt), 4, 3)])
        assert reply.offloaded and off.tokens == [prompt[-1]] and off.depth == 0
        await dc.reload()
        (after,), reply = await dc.speculate([SpeculateItem("rebuild", 3, [], len(prompt), 4, 3)])
        assert not reply.offloaded and reply.forwards == 4  # the rebuilt prompt, then 3 beam passes
        await dc.release(["rebuild"])
        return before, after

    before, after = _run(main())
    assert after.tokens == before.tokens and after.parents == before.parents and len(before.tokens) == 13
    assert after.path_prob == pytest.approx(before.path_prob, rel=1e-5)


def test_assumed_tokens_grow_the_tree_and_are_forgotten(services, prompts):
    """Drafting ahead: a tree grown from assumed tokens equals the tree grown once they are committed;
    afterwards the draft holds only the committed tokens (the next call must send the assumed ones)."""
    prompt = prompts["tiny"]

    async def main():
        dc, tc = await _clients(services)
        head, guess = prompt[:-2], prompt[-2:]
        (ahead,), _ = await dc.speculate([SpeculateItem("a", 1, prompt, len(head), 3, 2, assumed=2)])
        (wrong,), _ = await dc.speculate([SpeculateItem("a", 2, [], len(prompt), 3, 2)])
        assert wrong.error is not None and wrong.error.code == "out_of_sync"  # the guess was not kept
        (bad,), _ = await dc.speculate([SpeculateItem("b", 1, guess, 2, 3, 2, assumed=3)])
        assert bad.error is not None and bad.error.code == "bad_shape"
        (real,), _ = await dc.speculate([SpeculateItem("c", 1, head, len(head), 0, 1)])
        (real,), _ = await dc.speculate([SpeculateItem("c", 2, guess, len(prompt), 3, 2)])
        await dc.release(["a", "c"])
        await _assert_pools_empty(dc, tc)
        return ahead, real

    ahead, real = _run(main())
    assert ahead.tokens == real.tokens and ahead.parents == real.parents and ahead.tokens[0] == prompt[-1]
    assert ahead.path_prob == pytest.approx(real.path_prob, rel=1e-5)


def _raw_call(address: str, data: bytes, read: bool = True) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        if not read:
            return b""
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if len(b"".join(chunks)) >= PREFIX.size:
                _, hlen, plen = PREFIX.unpack(b"".join(chunks)[: PREFIX.size])
                if len(b"".join(chunks)) >= PREFIX.size + hlen + plen:
                    break
        return b"".join(chunks)


async def _exchange(address: str, frames: list[bytes]) -> list:
    """Send frames one by one on one authenticated connection, reading each reply."""
    reader, writer = await raw_link(address)
    replies = []
    for frame in frames:
        writer.write(frame)
        await writer.drain()
        replies.append(await read_frame(reader))
    writer.close()
    return replies


def _decode_reply(data: bytes):
    import msgspec

    from specserve.shared.wire.transport import Header

    _, hlen, _ = PREFIX.unpack(data[: PREFIX.size])
    return msgspec.msgpack.decode(data[PREFIX.size : PREFIX.size + hlen], type=Header)


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_malformed_frames_get_errors_and_the_service_keeps_serving(services, kind):
    service = dict(zip(("draft", "target"), services))[kind]
    cases = {
        "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "malformed_frame"),
        "oversized": (PREFIX.pack(MAGIC, 10, 1 << 40), "message_too_large"),
        "bad header": (PREFIX.pack(MAGIC, 5, 0) + b"\xc1\xc1\xc1\xc1\xc1", "bad_message"),
        "unknown type": (PREFIX.pack(MAGIC, 3, 0) + b"\x93\x07\x00\x00", "bad_message"),
    }
    for name, (data, code) in cases.items():
        reply = _decode_reply(_raw_call(service.address, data))
        assert isinstance(reply.body, Error) and reply.body.code == code, (name, reply)
    # A payload that disagrees with its message: one call fails, the connection still works.
    lying = frame_bytes(5, Forward([PrefillEntry("liar", 1, 0, 10, True, SamplingSpec())]),
                        {"prefill_tokens": _ints([1, 2, 3])})
    # The draft does not take Forward at all: a clear 'unsupported'.
    (first_id, first, _), (second_id, second, _) = _run(_exchange(service.address, [lying, frame_bytes(6, Health())]))
    assert first_id == 5 and isinstance(first, Error)
    assert first.code == ("bad_message" if kind == "target" else "unsupported"), first
    assert second_id == 6 and isinstance(second, HealthReply)  # the same connection still works
    assert service.alive()
    reply = _decode_reply(_raw_call(service.address, frame_bytes(9, Health())))
    assert isinstance(reply.body, HealthReply) and reply.call_id == 9


def test_bad_entries_are_refused_one_by_one(services, prompts):
    """Unknown ids, stale steps, a request larger than the whole KV pool and a broken tree each get
    their own error; the valid entries of the same calls run, and nothing leaks."""
    prompt = prompts["tiny"]

    async def main():
        dc, tc = await _clients(services)
        pool_tokens = (await tc.stats()).total_blocks * 16
        outs, _ = await tc.forward([PrefillItem("ok", 1, 0, prompt, True, SamplingSpec()),
                                    PrefillItem("huge", 1, 0, [5] * (pool_tokens + 1), True, SamplingSpec()),
                                    PrefillItem("ghost", 1, 7, [5, 6], True)])
        assert outs[0].error is None and len(outs[0].tokens) == 1
        assert outs[1].error.code == "too_large" and outs[2].error.code == "unknown_request"
        first = outs[0].tokens[0]
        committed = len(prompt) + 1
        cands, _ = await dc.speculate([SpeculateItem("ok", 2, prompt + [first], committed, 3, 2),
                                       SpeculateItem("ghost", 2, [], 5, 2, 2),
                                       SpeculateItem("huge", 2, [5] * (pool_tokens + 1), pool_tokens + 1, 2, 2)])
        assert cands[0].error is None and len(cands[0].tokens) == 7
        assert cands[1].error.code == "unknown_request"
        assert cands[2].error is None and cands[2].depth == 0  # kept, but too big to speculate: root only
        await dc.release(["huge"])
        tree = VerifyItem("ok", 2, committed, cands[0].tokens, cands[0].parents)
        outs, _ = await tc.forward(verify=[VerifyItem("nobody", 2, 3, [1], [-1]),
                                           VerifyItem("ok", 2, committed, [first, 1], [-1, 5])])  # broken tree
        assert [o.error.code for o in outs] == ["unknown_request", "invalid_tree"]
        outs, _ = await tc.forward(verify=[VerifyItem("ok", 2, committed + 4, cands[0].tokens, cands[0].parents)])
        assert outs[0].error.code == "out_of_sync"
        outs, _ = await tc.forward(verify=[tree])
        assert outs[0].error is None and len(outs[0].tokens) >= 1
        outs, _ = await tc.forward(verify=[tree])  # the same step again: refused, state unchanged
        assert outs[0].error.code == "stale_step"
        assert (await tc.release(["ok", "huge"])).released == ["ok"]
        await dc.release(["ok"])
        await _assert_pools_empty(dc, tc)

    _run(main())


def test_a_client_that_vanishes_mid_call_disturbs_no_one(services, prompts):
    draft, target = services
    prompt = prompts[next(k for k in prompts if k.startswith("medium"))] * 2

    async def main():
        dc, tc = await _clients(services)
        # Send a large prefill (and a draft catch-up) and hang up without reading the replies.
        for address, frame in (
            (target.address, frame_bytes(1, Forward([PrefillEntry("gone", 1, 0, len(prompt), True, SamplingSpec())]),
                                         {"prefill_tokens": _ints(prompt)})),
            (draft.address, _speculate_frame("gone", prompt)),
        ):
            _, writer = await raw_link(address)
            writer.write(frame)
            await writer.drain()
            writer.transport.abort()
        # Others are served meanwhile and after.
        outs, _ = await tc.forward([PrefillItem("other", 1, 0, prompts["tiny"], True, SamplingSpec())])
        assert outs[0].error is None
        assert (await dc.health()).status == "ok"
        # The vanished client's request did run (calls are atomic): "gone" is resident beside "other" in
        # the target and alone in the draft; releasing it frees everything.
        await poll.until_async(lambda: asyncio.gather(tc.stats(), dc.stats()), 30,
                               "the vanished client's calls to run (2 requests in the target, 1 in the draft)",
                               ok=lambda s: (s[0].resident_requests, s[1].resident_requests) == (2, 1))
        await tc.release(["gone", "other"])
        await dc.release(["gone"])
        await _assert_pools_empty(dc, tc)

    _run(main())
    assert draft.alive() and target.alive()


def _ints(values):
    return torch.tensor(values, dtype=torch.int32)


def _speculate_frame(rid: str, tokens: list[int]) -> bytes:
    from specserve.shared.wire.messages import Speculate, SpeculateEntry

    entry = SpeculateEntry(rid, 1, len(tokens), len(tokens), 4, 4)
    return frame_bytes(1, Speculate([entry]), {"tokens": _ints(tokens)})
