"""compose.yaml, checked by a real compose implementation and run as plain processes.

Here: the tests that start the whole stack; the others are in tests/unit/test_compose.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import poll
from tests.support.compose import COMPOSE, ROOT, ComposeStack
from tests.support.gateway import PROMPTS, complete_all
from tests.support.procs import health
from tests.support.promql import metric_names


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


def replicas(url: str) -> dict[str, dict]:
    """The gateway's replicas by address (host part)."""
    return {r["address"].rsplit(":", 1)[0]: r for r in health(url)["replicas"]}


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    poll.until(predicate, timeout_s, what, interval_s=0.2)


def service_metrics(host: str, port: int) -> dict[str, float]:
    text = httpx.get(f"http://{host}:{port}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels.get("call")}


def target_calls(stack, proc) -> float:
    port = int(stack.spec("target")["environment"]["SPECSERVE_TARGET_METRICS_PORT"])
    return service_metrics(proc.host, port)["specserve:service_calls_total"]


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
        # the gateway looks the name up again (every --discovery-interval-s, 5 s by default: compose does not
        # set it) and drains the replica that left it, whose pass still waits
        wait_for(lambda: replicas(url)[second.host]["state"] == "draining", "the second replica to be draining")
    finally:
        second.signal(signal.SIGCONT)
    try:
        texts = task.result(timeout=300)
    except Exception as exc:  # what the gateway did with the drained replica's requests
        raise AssertionError(f"the requests did not finish: {exc!r}\n{stack.gateway.log()[-6000:]}") from exc
    assert texts == reference  # drained, not lost
    wait_for(lambda: replicas(url)[second.host]["state"] == "dropped", "the second replica to be dropped")
    # the gateway's output reaches the test through a pipe read by a thread: wait for the line, do not race it
    wait_for(lambda: "drained and dropped" in stack.gateway.log(), "the gateway to log the drop")
    assert "draining its" in stack.gateway.log(), stack.gateway.log()[-3000:]
    port = int(stack.spec("target")["environment"]["SPECSERVE_TARGET_METRICS_PORT"])
    m = service_metrics(second.host, port)
    assert m["specserve:service_requests"] == 0 and m["specserve:service_kv_blocks_used"] == 0, m

    # New requests go to the replica that is left only.
    calls = target_calls(stack, second)
    assert asyncio.run(complete_all(url, PROMPTS)) == reference
    assert target_calls(stack, second) == calls
    assert json.dumps(health(url)["status"]) == '"ok"'

    # Idle again: the draft and the remaining replica hold no request and no block (releases were sent).
    draft_port = int(stack.spec("draft")["environment"]["SPECSERVE_DRAFT_METRICS_PORT"])

    def nothing_held() -> bool:
        d, t = service_metrics(stack.draft.host, draft_port), service_metrics(first.host, port)
        return d["specserve:service_requests"] == t["specserve:service_requests"] == 0 \
            and d["specserve:service_kv_blocks_used"] == t["specserve:service_kv_blocks_used"] == 0
    wait_for(nothing_held, "the services to hold nothing")


# ---- the dashboard and Prometheus against the running stack ----------------------------------------
DASHBOARD = ROOT / "deploy/grafana/dashboards/specserve.json"
PROMETHEUS_DIR = ROOT / "deploy/prometheus"
# PromQL words that are not metric names (functions, aggregations, keywords) and Prometheus's own `up`.
PROMETHEUS_OWN = {"up"}




def dashboard_exprs() -> list[str]:
    def walk(panels):
        for p in panels:
            yield from (t["expr"] for t in p.get("targets", []))
            yield from walk(p.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def stack_endpoints(stack) -> dict[str, list[str]]:
    """Prometheus job -> the stack's host:port of each /metrics (compose's ports)."""
    env = {n: stack.spec(n)["environment"] for n in ("gateway", "draft", "target")}
    return {"gateway": [f"{stack.gateway.host}:{env['gateway']['SPECSERVE_GATEWAY_PORT']}"],
            "draft": [f"{stack.draft.host}:{env['draft']['SPECSERVE_DRAFT_METRICS_PORT']}"],
            "target": [f"{t.host}:{env['target']['SPECSERVE_TARGET_METRICS_PORT']}" for t in stack.targets]}


def exported_names(stack) -> set[str]:
    names: set[str] = set()
    for addresses in stack_endpoints(stack).values():
        for address in addresses:
            text = httpx.get(f"http://{address}/metrics", timeout=30).text
            names |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    return names


def test_dashboard_and_alerts_name_only_exported_metrics(stack):
    assert asyncio.run(complete_all(stack.url, PROMPTS[:2])) is not None  # every tier-labelled series exists
    exported = exported_names(stack) | PROMETHEUS_OWN
    exprs = dashboard_exprs() + alert_exprs()
    assert len(dashboard_exprs()) >= 20
    unknown = {e: metric_names(e) - exported for e in exprs if metric_names(e) - exported}
    assert not unknown, unknown
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    for wanted in ("TTFT p50 / p99 per tier", "TPOT p50 / p99 per tier", "SLO attainment per tier", "Goodput per tier",
                   "Acceptance rate", "Mean accepted length", "Iteration time split", "Batch size and tokens per pass",
                   "KV usage", "Queue length", "Requests per replica", "Target pass time p50 / p99 per replica",
                   "Admission outcomes per tier", "Preemptions (best effort, by recompute)"):
        assert wanted in titles, wanted


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not shutil.which("promtool"):
        pytest.skip("no promtool: install Debian's prometheus package (scripts/test.sh does as root)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_config_and_rules(tmp_path):
    ok = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert ok.returncode == 0 and "SUCCESS" in ok.stdout, ok.stdout + ok.stderr
    assert promtool("check", "rules", str(PROMETHEUS_DIR / "alerts.yml")).returncode == 0
    broken = tmp_path / "alerts.yml"
    broken.write_text((PROMETHEUS_DIR / "alerts.yml").read_text().replace("< 0.9", "< < 0.9"))
    assert promtool("check", "rules", str(broken)).returncode != 0


def test_prometheus_scrapes_the_stack(stack, tmp_path):
    """The real Prometheus, with the shipped config's jobs and rules pointed at this stack."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: install Debian's prometheus package (scripts/test.sh does as root)")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    endpoints = stack_endpoints(stack)
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": endpoints[job["job_name"]]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", tmp_path / "alerts.yml")
    listen = f"{stack.gateway.host}:9090"
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={listen}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        api = f"http://{listen}/api/v1"

        def query(expr: str) -> list:
            body = httpx.get(f"{api}/query", params={"query": expr}, timeout=30).json()
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        def ready() -> bool:
            try:
                return httpx.get(f"http://{listen}/-/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "prometheus to be ready")
        asyncio.run(complete_all(stack.url, PROMPTS[:3]))
        gateway_text = httpx.get(f"{stack.url}/metrics", timeout=30).text
        direct = sum(s.value for f in text_string_to_metric_families(gateway_text) for s in f.samples
                     if s.name == "vllm:request_success_total")
        assert direct >= 3

        def scraped() -> bool:
            result = query('sum(vllm:request_success_total{job="gateway"})')
            return bool(result) and float(result[0]["value"][1]) == direct

        wait_for(scraped, "prometheus to scrape the gateway's counters")
        every = {(job, a): "1" for job, addresses in endpoints.items() for a in addresses}
        wait_for(lambda: {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1] for r in query("up")} == every,
                 "every job's targets to be scraped and up")  # each job's first scrape has its own offset
        calls = query('specserve:service_calls_total{job="target"}')
        assert len(calls) == 2 and all(float(r["value"][1]) > 0 for r in calls), calls
        for expr in dashboard_exprs():  # every panel's expression is valid PromQL here
            query(expr.replace("$__rate_interval", "15s"))  # Grafana's variable, as it would fill it in
        rules = httpx.get(f"{api}/rules", timeout=30).json()["data"]["groups"]
        assert sum(len(g["rules"]) for g in rules) == len(alert_exprs())
    finally:
        proc.terminate()
        proc.wait(30)
