"""Two target replicas behind one gateway: `specserve up --targets 2` as real processes, the openai client.

Here: the tests that start the whole stack; the others are in tests/service/test_replicas.py.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.shared.wire.service_client import TargetClient
from tests.support.fixtures import start_up
from tests.support.gateway import MAX_TOKENS, PROMPTS, aclient, run_all, wait_all_free
from tests.support.procs import await_health, health, kill, service_pid, wait_health


@pytest.fixture(scope="module")
def up2(request, suite_profile):
    return start_up(request, "--targets", "2", profile=suite_profile)


def wait_replicas_up(url: str, n: int) -> None:
    wait_health(url, lambda h: sum(r["up"] for r in h["replicas"]) >= n, f"{n} replicas ready")


def test_greedy_equals_transformers_and_spreads_over_both(up2, reference):
    assert [r["up"] for r in health(up2.url)["replicas"]] == [True, True]
    results = asyncio.run(run_all(up2.url, PROMPTS))
    assert [r.choices[0].text for r in results] == reference
    replicas = [r.model_extra["specserve"]["replica"] for r in results]
    assert set(replicas) == {0, 1}, replicas
    wait_all_free(up2)


def test_a_frozen_replica_holds_only_its_own_requests(up2, reference):
    """Replica 1 is frozen (SIGSTOP) once /health shows all four requests running, some on each replica
    (how many on each is the router's: its prefix affinity follows where earlier tests' prompts were
    cached): replica 0 serves its own to the end while replica 1's are still running there and it is
    still up (one loop for both replicas would hold replica 0's until replica 1's call ran out its
    deadline, then end replica 1's with an error). Thawed, replica 1 finishes its requests exactly."""
    wait_replicas_up(up2.url, 2)
    pid = service_pid("target", up2.addresses["target-1"])

    def spread(h: dict) -> bool:
        running = [r["running"] for r in h["replicas"]]
        return sum(running) == 4 and min(running) >= 1

    async def run():
        load = asyncio.ensure_future(run_all(up2.url, PROMPTS[:4]))
        seen = await await_health(up2.url, spread, until=load)
        assert seen is not None, "the load ended before both replicas ran their requests"
        os.kill(pid, signal.SIGSTOP)
        try:
            body = await await_health(up2.url, lambda h: h["replicas"][0]["running"] == 0, until=load)
            assert body is not None, "every request ended while replica 1 was frozen"
            assert body["replicas"][1]["up"] and body["replicas"][1]["running"] == seen["replicas"][1]["running"], body
        finally:
            os.kill(pid, signal.SIGCONT)
        return await load, [r["running"] for r in seen["replicas"]]

    out, split = asyncio.run(run())
    assert [r.choices[0].text for r in out] == reference[:4]
    assert sorted(r.model_extra["specserve"]["replica"] for r in out) == [0] * split[0] + [1] * split[1]
    wait_all_free(up2)


def test_entry_error_ends_only_that_request(up2, reference):
    """A stranger releases one running request on its replica: the next step refuses that entry
    (unknown_request); that stream alone ends with an error, the others finish exactly."""
    async def run():
        c = aclient(up2.url)
        streams = [await c.completions.create(model="target", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
                   for p in PROMPTS[:4]]
        firsts = [await s.__anext__() for s in streams]  # every stream has started: all are admitted
        victim = firsts[0].id
        replica = None
        for name in ("target-0", "target-1"):
            t = await TargetClient.connect(up2.addresses[name])
            if victim in (await t.release([victim])).released:
                replica = name
            await t.close()
        assert replica is not None

        async def rest(first, s):
            text = first.choices[0].text if first.choices else ""
            try:
                async for ch in s:
                    if ch.choices:
                        text += ch.choices[0].text
            except openai.APIError as exc:
                return exc
            return text

        out = await asyncio.gather(*[rest(f, s) for f, s in zip(firsts, streams)])
        await c.close()
        return out

    out = asyncio.run(run())
    assert isinstance(out[0], openai.APIError) and "unknown_request" in str(out[0]), out[0]
    assert out[1:] == reference[1:4]
    assert all(r["up"] for r in health(up2.url)["replicas"])
    wait_all_free(up2)


def test_a_killed_replicas_requests_resume_on_the_other_and_it_rejoins(up2, reference):
    """Replica 1 is killed once /health shows both replicas running requests (an event, not a fixed
    sleep). Its requests wait again and resume on replica 0 by recompute: every one of the six, streamed
    or not, ends with exactly transformers' greedy text (a stream goes on where it was: no token twice,
    none missing), and `specserve:requests_moved_total` counts the moved ones (at least one, unless every
    request of replica 1 finished between /health and the kill)."""
    async def one(c: openai.AsyncOpenAI, i: int, prompt: str) -> str:
        if i % 2:
            r = await c.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text
        stream = await c.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run():
        c = aclient(up2.url)
        load = asyncio.ensure_future(asyncio.gather(*[one(c, i, p) for i, p in enumerate(PROMPTS[:6])],
                                                    return_exceptions=True))
        seen = await await_health(up2.url, lambda h: all(r["running"] >= 1 for r in h["replicas"]), until=load)
        assert seen is not None, "the load ended before both replicas ran their requests"
        kill("target", up2.addresses["target-1"])
        out = await load
        await c.close()
        return seen, out

    seen, out = asyncio.run(run())
    assert out == reference[:6], (seen, out)
    moved = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{up2.url}/metrics").text)
             for s in f.samples}["specserve:requests_moved_total"]
    assert moved >= 1, ("no request was on the killed replica", seen)
    # while replica 1 is down (or being restarted), new requests are still served, exactly
    again = asyncio.run(run_all(up2.url, PROMPTS[:2]))
    assert [r.choices[0].text for r in again] == reference[:2]
    # `up` restarts it on the same address; the gateway reconnects; new requests reach it again
    wait_replicas_up(up2.url, 2)
    later = asyncio.run(run_all(up2.url, PROMPTS))
    assert [r.choices[0].text for r in later] == reference
    assert {r.model_extra["specserve"]["replica"] for r in later} == {0, 1}
    wait_all_free(up2)


def test_a_replica_killed_while_idle_takes_no_new_request(up2, reference):
    """Replica 1 is killed while nothing runs, and four requests are sent at once as soon as it has died
    (`up` restarts it seconds later): its connection is closed, so the gateway routes every one of them to
    replica 0, and all four complete exactly. (Routed by its last call, a replica killed while idle still
    looked up: requests bound to it failed at their first pass, "the target service failed: Broken pipe",
    and bench/soak.py counted them lost.)"""
    wait_replicas_up(up2.url, 2)
    wait_all_free(up2)
    kill("target", up2.addresses["target-1"])
    out = asyncio.run(run_all(up2.url, PROMPTS[:4]))
    failed = [r for r in out if isinstance(r, BaseException)]
    assert not failed, failed
    assert [r.choices[0].text for r in out] == reference[:4]
    assert {r.model_extra["specserve"]["replica"] for r in out} == {0}
    wait_replicas_up(up2.url, 2)
    wait_all_free(up2)


def test_poison_on_one_replica_touches_nothing_else(up2, reference):
    """A request with sampling values that once failed the target's whole pass (temperature 1e-38) is
    served beside greedy requests on both replicas, sent once /health shows all four running: every
    greedy request finishes exactly, both replicas stay up. (A whole call answered with an error, the
    remote-error path, is exercised against a real target in
    test_executor_tells_remote_errors_from_dead_services_and_deadlines.)"""
    wait_replicas_up(up2.url, 2)  # a replica killed by an earlier test may still be reconnecting

    async def run():
        good = asyncio.ensure_future(run_all(up2.url, PROMPTS[:4]))
        await await_health(up2.url, lambda h: h["running"] == 4, until=good)
        async with httpx.AsyncClient(base_url=up2.url, timeout=60) as h:
            bad = await h.post("/v1/completions", json={"model": "target", "prompt": "x = ", "max_tokens": 8,
                                                        "temperature": 1e-38})
        return bad, await good

    bad, out = asyncio.run(run())
    assert bad.status_code in (200, 400, 500), bad.text
    served = [(i, r) for i, r in enumerate(out) if not isinstance(r, BaseException)]
    assert len(served) == len(out), [r for r in out if isinstance(r, BaseException)]
    for i, r in served:
        assert r.choices[0].text == reference[i]
    assert [r["up"] for r in health(up2.url)["replicas"]] == [True, True]
    assert health(up2.url)["status"] == "ok"
    later = asyncio.run(run_all(up2.url, PROMPTS[:2]))
    assert [r.choices[0].text for r in later] == reference[:2]
    wait_all_free(up2)
