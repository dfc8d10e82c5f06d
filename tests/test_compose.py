"""compose.yaml, checked by a real compose implementation and run as plain processes.

- `docker-compose config` (or `docker compose config`) accepts compose.yaml and the GPU override,
  and refuses a broken copy (so the check can fail);
- the `secret`, `draft`, two `target` replicas and `gateway` services run with their exact
  commands and environment (tests/compose_stack.py says what differs from a container and why);
  the gateway finds the target replicas by resolving the name `target` (`--discover-targets`,
  here through its hosts file, in containers through compose's DNS):
  - a replica that appears in the name's addresses joins, and requests are spread over both;
  - the official openai client's greedy output equals transformers';
  - a replica whose address vanishes while it serves requests is drained: its requests finish
    with the same greedy output, it is then dropped and holds no request and no KV block (its own
    /metrics), and later requests go to the other replica only.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.compose_stack import COMPOSE, ROOT, ComposeStack
from tests.test_gateway import MAX_TOKENS, PROMPTS, aclient


def compose_command() -> list[str] | None:
    """A real compose implementation: Debian's docker-compose, or docker's compose plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def compose_config(*files, cwd=ROOT) -> subprocess.CompletedProcess:
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no compose implementation: install Debian's docker-compose (scripts/test.sh does as root)")
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run([*cmd, *args, "config", "-q"], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_compose_config_validates(tmp_path):
    ok = compose_config(COMPOSE, ROOT / "compose.gpu.yaml")
    assert ok.returncode == 0, ok.stderr
    broken = tmp_path / "compose.yaml"
    text = COMPOSE.read_text().replace("condition: service_healthy", "condition: when_it_feels_like_it", 1)
    broken.write_text(text)
    bad = compose_config(broken, cwd=tmp_path)
    assert bad.returncode != 0 and "condition" in bad.stderr, bad.stderr


# ---- the stack as processes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """secret, draft, two target replicas and gateway of compose.yaml; the name `target` first
    resolves to the first replica only."""
    s = ComposeStack(tmp_path_factory.mktemp("compose"), f"127.{random.randint(16, 250)}.{random.randint(1, 250)}")
    try:
        s.wait_done(s.start("secret"))
        draft = s.start("draft")
        targets = [s.start("target"), s.start("target")]
        s.set_hosts("draft", [draft.host])
        s.set_hosts("target", [targets[0].host])
        for dep, condition in s.depends_on("gateway").items():
            assert condition == "service_healthy", (dep, condition)
            for p in s.procs:
                if p.name == dep:
                    s.wait_healthy(p)
        s.gateway = s.start("gateway")
        s.wait_healthy(s.gateway)
        s.draft, s.targets = draft, targets
        s.url = f"http://{s.gateway.host}:{s.spec('gateway')['environment']['SPECSERVE_GATEWAY_PORT']}"
        yield s
    finally:
        s.stop()


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def replicas(url: str) -> dict[str, dict]:
    """The gateway's replicas by address (host part)."""
    return {r["address"].rsplit(":", 1)[0]: r for r in health(url)["replicas"]}


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def service_metrics(host: str, port: int) -> dict[str, float]:
    text = httpx.get(f"http://{host}:{port}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels.get("call")}


def target_calls(stack, proc) -> float:
    port = int(stack.spec("target")["environment"]["SPECSERVE_TARGET_METRICS_PORT"])
    return service_metrics(proc.host, port)["specserve:service_calls_total"]


async def complete_all(url: str, prompts: list[str]) -> list[str]:
    c = aclient(url)
    try:
        results = await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=MAX_TOKENS,
                                                              temperature=0) for p in prompts])
    finally:
        await c.close()
    return [r.choices[0].text for r in results]


def test_compose_processes_parity_and_scaling(stack, reference):
    url, (first, second) = stack.url, stack.targets
    assert [r["state"] for r in replicas(url).values()] == ["up"]

    # A second address for `target` (docker compose up --scale target=2): it joins.
    stack.set_hosts("target", [first.host, second.host])
    wait_for(lambda: [r["state"] for r in replicas(url).values()] == ["up", "up"], "the second replica to join")
    before = [target_calls(stack, p) for p in (first, second)]
    assert asyncio.run(complete_all(url, PROMPTS)) == reference
    after = [target_calls(stack, p) for p in (first, second)]
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas served

    # The second replica's address vanishes while it serves requests: it drains, then it is dropped.
    pool = ThreadPoolExecutor(1)
    for _attempt in range(5):
        task = pool.submit(asyncio.run, complete_all(url, PROMPTS))
        wait_for(lambda t=task: replicas(url)[second.host]["running"] > 0 or t.done(), "requests on the second replica")
        second.signal(signal.SIGSTOP)  # its pass waits: its requests stay in flight while the set changes
        if replicas(url)[second.host]["running"] > 0:
            break
        second.signal(signal.SIGCONT)
        assert task.result() == reference
    else:
        pytest.fail("could not catch requests in flight on the second replica")
    try:
        stack.set_hosts("target", [first.host])
        interval = 5.0  # the gateway's --discovery-interval-s default (compose does not set it)
        time.sleep(2 * interval + 1)  # the gateway has looked the name up again (its pass still waits)
    finally:
        second.signal(signal.SIGCONT)
    assert task.result(timeout=300) == reference  # drained, not lost
    wait_for(lambda: replicas(url)[second.host]["state"] == "dropped", "the second replica to be dropped")
    assert "draining its" in stack.gateway.log() and "drained and dropped" in stack.gateway.log(), \
        stack.gateway.log()[-3000:]
    port = int(stack.spec("target")["environment"]["SPECSERVE_TARGET_METRICS_PORT"])
    m = service_metrics(second.host, port)
    assert m["specserve:service_requests"] == 0 and m["specserve:service_kv_blocks_used"] == 0, m

    # New requests go to the replica that is left only.
    calls = target_calls(stack, second)
    assert asyncio.run(complete_all(url, PROMPTS)) == reference
    assert target_calls(stack, second) == calls
    assert json.dumps(health(url)["status"]) == '"ok"'
