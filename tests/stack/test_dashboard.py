"""Every panel of the bundled Grafana dashboard has data under a plain `specserve up` (issue 33).

Here: the tests that start the whole stack; the others are in tests/unit/test_dashboard.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specserve.shared.host.launch import free_port
from tests.support import poll
from tests.support.fixtures import start_up

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/specserve.json"
PROMETHEUS_DIR = ROOT / "deploy/prometheus"
LOCAL = PROMETHEUS_DIR / "local.yml"
GRAFANA_INTERVALS = ("$__rate_interval", "$__interval", "$__range", "${__rate_interval}", "${__interval}",
                     "${__range}")


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, rows' panels included."""
    def walk(panels: list[dict]):
        for p in panels:
            yield from ((p.get("title", "?"), t["expr"]) for t in p.get("targets", []) if t.get("expr"))
            yield from walk(p.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def fill_in(expr: str, window: str) -> str:
    """The expression as Grafana sends it: its interval variables as `window`, each template variable
    as "All" (`.*`, which fits the `=~` matchers such variables are used in)."""
    for name in GRAFANA_INTERVALS:
        expr = expr.replace(name, window)
    variables = [v["name"] for v in json.loads(DASHBOARD.read_text()).get("templating", {}).get("list", [])]
    for name in variables:
        expr = re.sub(r"\$\{" + re.escape(name) + r"(?::\w+)?\}|\$" + re.escape(name) + r"\b", ".*", expr)
    assert "$" not in expr, f"a Grafana variable this test does not fill in: {expr}"
    return expr


def test_promtool_checks_the_local_config():
    if not shutil.which("promtool"):
        pytest.skip("no promtool: install Debian's prometheus package (scripts/test.sh does as root)")
    ok = subprocess.run(["promtool", "check", "config", str(LOCAL)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SUCCESS" in ok.stdout, ok.stdout + ok.stderr


# ---- the dashboard against a live `specserve up` -------------------------------------------------
def scrape_targets(up) -> dict[str, list[str]]:
    """Prometheus job -> the host:port of each /metrics of this `up` (a service without one: none)."""
    def address(url: str) -> str:
        return urlsplit(url).netloc

    return {"gateway": [address(up.metrics["gateway"])],
            "draft": [address(u) for n, u in up.metrics.items() if n == "draft"],
            "target": [address(u) for n, u in up.metrics.items() if n.startswith("target")]}


class Prometheus:
    """The real Prometheus binary on local.yml's jobs and rules, pointed at `targets`, scraping every second."""

    def __init__(self, targets: dict[str, list[str]], directory: Path):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("no prometheus binary: install Debian's prometheus package (scripts/test.sh does as root)")
        config = yaml.safe_load(LOCAL.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(PROMETHEUS_DIR / "alerts.yml", directory / "alerts.yml")
        self.listen = f"127.0.0.1:{free_port()}"
        self.api = f"http://{self.listen}/api/v1"
        self.log = directory / "prometheus.log"  # a file, not a pipe nobody reads (a full pipe would block it)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([binary, f"--config.file={directory / 'prometheus.yml'}",
                                          f"--storage.tsdb.path={directory / 'data'}",
                                          f"--web.listen-address={self.listen}"],
                                         stdout=subprocess.DEVNULL, stderr=log)
        self.started = time.monotonic()

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-3000:]}"
        try:
            return httpx.get(f"http://{self.listen}/-/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.api}/query", params={"query": expr}, timeout=30).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def window(self) -> str:
        """A range that covers everything scraped so far (`$__rate_interval` stands for it)."""
        return f"{math.ceil(time.monotonic() - self.started) + 10}s"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def empty_panels(prom: Prometheus, finite: bool) -> list[str]:
    """'title: expr' of each dashboard query with no series (finite: with no series of a finite value)."""
    window = prom.window()
    empty = []
    for title, expr in panel_queries():
        values = [float(r["value"][1]) for r in prom.query(fill_in(expr, window))]
        if not values or (finite and not any(math.isfinite(v) for v in values)):
            empty.append(f"{title}: {expr} -> {values}")
    return empty


async def load(url: str) -> int:
    """A few chat completions at once through the official client, half of them streamed; the number sent."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = ["def fibonacci(n):", "Write a haiku about the sea.", "import numpy as np\n", "hi there"]

    async def plain(prompt: str) -> None:
        reply = await client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=24, temperature=0)
        assert reply.choices[0].message.content

    async def streamed(prompt: str) -> None:
        stream = await client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=24, temperature=0, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text

    async with client:
        await asyncio.gather(*(plain(p) for p in prompts), *(streamed(p) for p in prompts))
    return 2 * len(prompts)


def gateway_successes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total")


@pytest.fixture(scope="module")
def drafting_up(request, suite_profile):
    """`specserve up` as conftest's `up` starts it, with a policy that always drafts."""
    return start_up(request, "--policy", "chain:4", profile=suite_profile)


def test_every_dashboard_query_has_data_under_up(drafting_up, tmp_path):
    up = drafting_up
    assert len(panel_queries()) >= 20  # the walk found the dashboard's queries
    targets = scrape_targets(up)
    prom = Prometheus(targets, tmp_path)
    try:
        poll.until(prom.ready, 120, "prometheus to become ready", interval_s=0.2)
        every = {(job, a) for job, addresses in targets.items() for a in addresses}
        poll.until(lambda: {(r["metric"]["job"], r["metric"]["instance"]) for r in prom.query("up == 1")}, 120,
                   f"every /metrics scraped and up: {targets} (up: the last value)", ok=lambda up: up == every,
                   interval_s=0.2)
        # Before any request every query has a series (rate() needs two scrapes of each: hence a wait).
        poll.until(lambda: empty_panels(prom, finite=False), 30,
                   "a series for every query before any request (without one: the last value)",
                   ok=lambda idle: not idle, interval_s=0.2, show=lambda idle: "\n" + "\n".join(idle))
        assert gateway_successes(up.url) == 0  # nothing was sent yet: those series were there from the start

        sent = asyncio.run(load(up.url))
        direct = gateway_successes(up.url)
        assert direct == sent

        wanted_calls = {("target", "Forward")} | ({("draft", "Speculate")} if targets["draft"] else set())

        def counts() -> dict[str, list]:
            return {"done": prom.query('sum(vllm:request_success_total{job="gateway"})'),
                    "calls": prom.query('sum by (service, call) (specserve:service_call_seconds_count)')}

        def scraped(seen: dict[str, list]) -> bool:  # Prometheus has the gateway's final counts, and the calls
            called = {(r["metric"]["service"], r["metric"]["call"]) for r in seen["calls"] if float(r["value"][1]) > 0}
            return bool(seen["done"]) and float(seen["done"][0]["value"][1]) == direct and \
                {("target", "Forward"), ("draft", "Speculate")} & called == wanted_calls

        seen = poll.until(counts, 120, f"prometheus to scrape the counts after the load ({direct} requests)",
                          ok=scraped, interval_s=0.2)
        empty = empty_panels(prom, finite=True)
        assert not empty, f"dashboard queries with no data after the load ({seen}):\n" + "\n".join(empty)
    finally:
        prom.stop()
