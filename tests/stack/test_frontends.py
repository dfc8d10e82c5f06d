"""`--frontends 2`: the gateway process runs the engine, two front-end processes serve HTTP on one port
(`specserve up -- --frontends 2`, real processes, the openai client and plain HTTP).

- greedy output equals transformers', streamed and not; structured output (guided_choice) through the
  link; /health, /metrics, /v1/slo_classes answer through a front end; a bad request is a 400 there and
  is counted in the engine's metrics;
- a front end killed mid-stream (SIGKILL) costs only the streams it served: the other front end's
  streams finish exactly, the engine aborts the dead one's requests (nothing keeps running on the
  target), new requests are served, and the dead front end is started again;
- a front end run on its own (`specserve gateway --frontend-of HOST:PORT`, the engine started with
  `--frontend-link HOST:PORT`) serves exactly over TCP; one with another secret exits with a clear
  error, and a connection that sends a request before the handshake is closed unserved, as is one
  that announces a frame over wire.MAX_HANDSHAKE_BYTES before it (at once: the body is never awaited);
- a front end started before its engine waits for it (RemoteEngine.connect_retrying) and serves once
  the engine's link accepts connections.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from specserve.gateway.frontend import wire
from specserve.shared.host.launch import free_port
from specserve.shared.wire.messages import SamplingSpec
from tests.support import poll
from tests.support.fixtures import start_up
from tests.support.gateway import MAX_TOKENS, PROMPTS, client, run_all
from tests.support.procs import health, wait_health

SECRET = "the-frontends-test-secret-0123456789"


def _env(secret: str) -> dict[str, str]:
    env = {**os.environ, "SPECSERVE_SECRET": secret}
    env.pop("SPECSERVE_SECRET_FILE", None)
    return env


@pytest.fixture(scope="module")
def link_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def up_fe(request, suite_profile, link_port):
    return start_up(request, profile=suite_profile,
                    gateway_args=("--frontends", "2", "--frontend-link", f"127.0.0.1:{link_port}"), env=_env(SECRET))


def frontend_pids() -> set[int]:
    """The pids of the running front-end processes (`specserve gateway ... --frontend-of SOCKET`)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"specserve.cli" in argv and b"--frontend-of" in argv:
                out.add(int(entry))
    return out


async def stream_text(client: httpx.AsyncClient, prompt: str, started: asyncio.Queue) -> str | Exception:
    """One streamed completion by hand (so the serving front end's pid is seen in the headers): its text,
    or the error that cut it. Puts (pid, index) on `started` once the first event arrived."""
    body = {"model": "target", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            pid = int(resp.headers["x-specserve-frontend"])
            first = True
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                text += event["choices"][0]["text"] if event["choices"] else ""
                if first:
                    first = False
                    await started.put(pid)
    except (httpx.HTTPError, ConnectionError) as exc:
        return exc
    return text


def test_two_frontends_serve_exactly(up_fe, reference):
    assert len(frontend_pids()) == 2
    out = asyncio.run(run_all(up_fe.url, PROMPTS))
    assert [r.choices[0].text for r in out] == reference

    async def streamed() -> list[str | Exception]:
        started: asyncio.Queue = asyncio.Queue()
        async with httpx.AsyncClient(base_url=up_fe.url, timeout=300) as c:
            return list(await asyncio.gather(*[stream_text(c, p, started) for p in PROMPTS[:4]]))

    assert asyncio.run(streamed()) == reference[:4]
    for choices in (["alpha", "beta"], ["0", "1", "22"]):  # the engine compiles the grammar the front end names
        guided = asyncio.run(run_all(up_fe.url, PROMPTS[:2], extra_body={"guided_choice": choices}))
        assert all(r.choices[0].text in choices for r in guided), guided
    body = health(up_fe.url)
    assert body["status"] == "ok" and body["running"] == 0, body
    assert "classes" in httpx.get(f"{up_fe.url}/v1/slo_classes", timeout=30).json()
    bad = httpx.post(f"{up_fe.url}/v1/completions", timeout=30,
                     json={"model": "target", "prompt": "x", "max_tokens": 100_000})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded", bad.text
    metrics = httpx.get(f"{up_fe.url}/metrics", timeout=30).text
    counted = [line for line in metrics.splitlines()
               if line.startswith("specserve:request_errors_total") and 'code="context_length_exceeded"' in line]
    assert counted and float(counted[0].split()[-1]) >= 1, counted
    # the sampling fields cross the link: n choices, each the request with seed + i, penalties and stop ids
    kw = dict(model="target", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, presence_penalty=0.5,
              extra_body={"min_tokens": 2, "stop_token_ids": [7], "repetition_penalty": 1.2})
    two = client(up_fe.url).completions.create(**kw, n=2)
    alone = [client(up_fe.url).completions.create(**{**kw, "seed": 3 + i}).choices[0].text for i in range(2)]
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == alone


def aborted(url: str) -> float:
    """vllm:request_success_total{finished_reason="abort"} from the engine's metrics (through a front end)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.split()[-1])
    raise AssertionError("no abort series")


def test_a_killed_frontend_costs_only_its_streams(up_fe, reference):
    before = frontend_pids()
    assert len(before) == 2
    aborted_before = aborted(up_fe.url)

    async def run() -> tuple[int, list[str | Exception]]:
        started: asyncio.Queue = asyncio.Queue()
        async with httpx.AsyncClient(base_url=up_fe.url, timeout=300,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as c:
            tasks = [asyncio.ensure_future(stream_text(c, p, started)) for p in PROMPTS[:6]]
            victim = await started.get()  # the front end serving the first stream to start
            os.kill(victim, signal.SIGKILL)
            return victim, list(await asyncio.gather(*tasks))

    victim, out = asyncio.run(run())
    cut = [i for i, r in enumerate(out) if isinstance(r, Exception)]
    assert cut, "no stream was on the killed front end"
    for i, r in enumerate(out):
        assert isinstance(r, Exception) or r == reference[i], (i, r)
    # its requests were aborted in the engine: nothing runs on after their clients are gone
    wait_health(up_fe.url, lambda h: h["running"] == 0 and h["waiting"] == 0, "the dead front end's requests ended")
    assert aborted(up_fe.url) > aborted_before, "the engine did not abort the dead front end's requests"
    later = asyncio.run(run_all(up_fe.url, PROMPTS[:4]))
    assert [r.choices[0].text for r in later] == reference[:4]
    # the engine process started a new front end in its place
    wait_health(up_fe.url, lambda h: len(frontend_pids()) == 2 and victim not in frontend_pids(),
                "the killed front end started again")


class OwnFrontend:
    """`specserve gateway --frontend-of 127.0.0.1:PORT --port 0`, started by hand as a Deployment would;
    `url` is its ready line's address, None when it exited instead (read at once, or by `ready()`)."""

    def __init__(self, link_port: int, secret: str, wait_ready: bool = True):
        self.proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "gateway", "--frontend-of",
                                      f"127.0.0.1:{link_port}", "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(secret))
        self.url: str | None = None
        if wait_ready:
            self.ready()

    def ready(self) -> str | None:
        """Wait for the ready line ("" when the process exits first); its address, or None."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.url = line.split()[-1] if line.startswith("ready frontend") else None
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


INTRUDER = wire.frame(wire.Submit("intruder", [1, 2, 3], SamplingSpec(), 8, "standard", 100.0, 1000.0, [], True))


async def unauthenticated(port: int, data: bytes) -> bytes:
    """`data` sent first thing on a new link connection: what comes back before the engine closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 60)  # b"" once the engine closes it
    writer.close()
    return data


def test_a_frontend_of_its_own_over_tcp(up_fe, reference, link_port):
    assert asyncio.run(unauthenticated(link_port, INTRUDER)) == b""
    wrong = OwnFrontend(link_port, "not-the-engines-secret-0123456789")
    assert wrong.url is None and wrong.proc.wait(60) == 1
    assert "cannot authenticate to the engine" in wrong.proc.stderr.read()
    own = OwnFrontend(link_port, SECRET)
    assert own.url is not None, own.proc.stderr.read()
    try:
        out = asyncio.run(run_all(own.url, PROMPTS[:4]))
        assert [r.choices[0].text for r in out] == reference[:4]

        async def streamed() -> list[str | Exception]:
            async with httpx.AsyncClient(base_url=own.url, timeout=300) as c:
                return list(await asyncio.gather(*[stream_text(c, p, asyncio.Queue()) for p in PROMPTS[4:6]]))

        assert asyncio.run(streamed()) == reference[4:6]
        assert health(own.url)["status"] == "ok"
    finally:
        own.stop()
    body = health(up_fe.url)  # the intruder's Submit was never queued
    assert body["running"] == 0 and body["waiting"] == 0, body
    later = asyncio.run(run_all(up_fe.url, PROMPTS[:2]))
    assert [r.choices[0].text for r in later] == reference[:2]


def wait_for_line(lines, text: str, timeout_s: float = 60.0) -> str:
    """The first line of `lines` (a growing sequence, read by another thread) that contains `text`."""
    return poll.until(lambda: next((line for line in list(lines) if text in line), None), timeout_s,
                      f"a line with {text!r}", ok=lambda found: found is not None,
                      show=lambda _: "".join(list(lines)[-20:]))


def test_a_frame_over_the_handshake_limit_is_refused_before_its_body(up_fe, link_port):
    """A header announcing 1 MiB (a frame the link takes once authenticated), and nothing after it: the
    engine closes the connection at once, saying why, instead of waiting for the body until the
    handshake's deadline."""
    huge = 2**20
    assert asyncio.run(unauthenticated(link_port, wire.LENGTH.pack(huge))) == b""
    line = wait_for_line(up_fe.stderr, f"a frame of {huge} bytes")
    assert f"(at most {wire.MAX_HANDSHAKE_BYTES})" in line and "was refused" in line


class Forwarder:
    """A TCP port that forwards every connection to another port, started when the test says so (a
    link address where, at first, nothing listens)."""

    def __init__(self, to_port: int):
        self.port, self.to_port = free_port(), to_port
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(asyncio.start_server(self._pipe, "127.0.0.1", self.port),
                                         self.loop).result(30)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.to_port)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer), return_exceptions=True)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_frontend_started_before_its_engine_waits_for_it(up_fe, reference, link_port):
    forwarder = Forwarder(link_port)  # nothing listens on forwarder.port yet
    early = OwnFrontend(forwarder.port, SECRET, wait_ready=False)
    try:
        err: list[str] = []
        threading.Thread(target=lambda: err.extend(early.proc.stderr), daemon=True).start()
        wait_for_line(err, f"waiting for the engine at 127.0.0.1:{forwarder.port}")
        assert early.proc.poll() is None
        forwarder.start()  # the engine's link is there now
        url = early.ready()
        assert url is not None, "".join(err)
        out = asyncio.run(run_all(url, PROMPTS[:2]))
        assert [r.choices[0].text for r in out] == reference[:2]
    finally:
        early.stop()
        forwarder.stop()
