"""`specserve bench`: the pure parts (arrivals, mix, records, /metrics parsing) on hand-made inputs, then the real
CLI against one real `specserve up`, with vLLM's `ignore_eos` checked through the official openai client.

Here: the tests that start the whole stack; the others are in tests/unit/test_bench.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from specserve.cli.loadgen.arrivals import (
    gamma_arrivals,
    load_trace,
    piecewise_arrivals,
    trace_arrivals,
)
from specserve.cli.loadgen.runner import summary_path
from specserve.cli.loadgen.scrape import parse_counters, server_delta
from specserve.cli.loadgen.workload import (
    DEFAULT_MIX,
    counts_for,
    parse_mix,
)
from specserve.gateway.perf.profile import Profile
from specserve.gateway.sched.policy import DEFAULT_POLICY
from tests.support.fixtures import fresh_profile, start_up
from tests.support.procs import Up, gateway

ROOT = Path(__file__).resolve().parents[2]
SHORT = [json.loads(line) for line in (ROOT / "bench/workloads/short.jsonl").read_text().splitlines()]
# The demo target continues this prompt (short-0038 without its final newline) with one newline and then EOS.
EOS_PROMPT = SHORT[38]["prompt"].removesuffix("\n")


# ================================================================================================ end to end
@pytest.fixture(scope="module")
def up(request, tmp_path_factory):
    profile = fresh_profile(tmp_path_factory, "bench-profile")
    Profile(budget_tokens=24, baseline_iteration_ms=40.0, knee_ratio=1.2, curve=[(8, 30.0), (24, 40.0), (48, 70.0)],
            model="target", device="cpu", dtype="float32", created="2025-01-01T00:00:00", batch=8, input_tokens=32,
            output_tokens=128, reference_ms=30.0).save(profile)
    # FIFO admission: the bench's accounting needs a request served that misses its SLO (critical = 1 ms),
    # which SLO admission (the default) would refuse instead
    return start_up(request, profile=profile,
                    gateway_args=("--slo-class", "critical=1", "--slo-class", "chat=1000000", "--admission", "fifo"))


def bench_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def run12(up, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run.jsonl"
    proc = bench_cli("--url", up.url, "-n", "12", "--request-rate", "20", "--max-tokens", "12", "--ignore-eos",
                     "--seed", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return proc, read_records(out), json.loads(summary_path(out).read_text())


def test_bench_records(up, run12):
    _, records, _ = run12
    classes = httpx.get(f"{up.url}/v1/slo_classes").json()["classes"]
    assert [r["index"] for r in records] == list(range(12))
    for r in records:
        assert r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length", r
        assert r["completion_tokens"] == 12 and r["prompt_tokens"] > 0  # ignore_eos: exactly max_tokens
        assert 0 < r["ttft_ms"] <= r["latency_ms"]
        assert r["tpot_ms"] == pytest.approx((r["latency_ms"] - r["ttft_ms"]) / 11, rel=1e-12)
        assert r["slo_tpot_ms"] == classes[r["category"]]["tpot_ms"]
        assert r["slo_ttft_ms"] == classes[r["category"]]["ttft_ms"]
        assert r["prompt_id"].startswith(f"{r['workload']}-")
        assert r["workload"] == {"critical": "short", "search": "long", "chat": "short"}[r["category"]]
        assert r["steps"] >= 1 and r["step_tokens"] >= r["steps"]
    assert [r["scheduled_s"] for r in records] == pytest.approx(gamma_arrivals(12, 20.0, 1.0, 1), abs=1e-12)
    counts = dict(zip(("critical", "search", "chat"), counts_for(parse_mix(DEFAULT_MIX), 12)))
    assert Counter(r["category"] for r in records) == counts == {"critical": 7, "search": 3, "chat": 2}


def test_bench_summary(run12):
    proc, records, s = run12
    met = [r for r in records if r["tpot_ms"] <= r["slo_tpot_ms"] and r["ttft_ms"] <= r["slo_ttft_ms"]]
    assert 0 < len(met) < 12  # critical = 1 ms is missed, chat = 10^6 ms met
    assert s["requests"] == s["completed"] == 12 and s["errors"] == 0 and s["error_kinds"] == {}
    assert s["attainment"] == len(met) / 12
    assert s["goodput_tok_s"] == pytest.approx(sum(r["completion_tokens"] for r in met) / s["duration_s"], rel=1e-12)
    assert s["output_tokens"] == 144
    assert s["duration_s"] >= max(r["sent_s"] + r["latency_ms"] / 1e3 for r in records) - min(
        r["sent_s"] for r in records) - 1e-9
    assert s["label"] == DEFAULT_POLICY and s["policy"]["name"] == DEFAULT_POLICY  # the server's, by default
    for cat, n in {"critical": 7, "search": 3, "chat": 2}.items():
        c = s["categories"][cat]
        mine = [r for r in records if r["category"] == cat]
        assert c["requests"] == n == len(mine)
        assert c["attainment"] == sum(r["tpot_ms"] <= r["slo_tpot_ms"] and r["ttft_ms"] <= r["slo_ttft_ms"]
                                      for r in mine) / n
        assert c["tpot_attainment"] == sum(r["tpot_ms"] <= r["slo_tpot_ms"] for r in mine) / n
    assert s["categories"]["critical"]["attainment"] == 0.0 and s["categories"]["chat"]["attainment"] == 1.0
    it = s["iteration"]
    assert it["iterations"] > 0 and it["mean_ms"] > 0
    assert sum(it["share"].values()) == pytest.approx(1.0, abs=1e-9)
    assert all(0 <= v <= 1 for v in it["share"].values()) and it["seconds"]["target"] > 0
    assert s["tokens_per_step"] >= 1
    assert s["tokens_per_step"] == pytest.approx(sum(r["step_tokens"] for r in records)
                                                 / sum(r["steps"] for r in records))
    assert s["config"]["num_requests"] == 12 and s["config"]["ignore_eos"] is True
    lines = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["category", "SLO"] for line in lines)
    for cat, n in {"critical": 7, "search": 3, "chat": 2}.items():
        row = next(line.split() for line in lines if line.startswith(cat))
        assert float(row[1]) == s["categories"][cat]["slo_tpot_ms"] and int(row[2]) == n
    assert f"SLO attainment {100 * s['attainment']:.1f} % (TTFT and TPOT; TPOT alone" in proc.stdout
    assert f"iterations {it['iterations']}" in proc.stdout


def test_bench_trace_replay(up, tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("# seconds\n12.0\n10.0\n\n10.5\n11.5\n99\n")
    out = tmp_path / "trace.jsonl"
    proc = bench_cli("--url", up.url, "-n", "4", "--trace", str(trace), "--request-rate", "20", "--max-tokens", "3",
                     "--mix", "chat=1:short", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = read_records(out)
    # 10, 10.5, 11.5, 12 -> 0, 0.5, 1.5, 2 -> scaled by 3 gaps / 20 req/s / 2 s = 0.075
    assert [r["scheduled_s"] for r in records] == pytest.approx([0.0, 0.0375, 0.1125, 0.15], rel=1e-12)
    assert [r["scheduled_s"] for r in records] == trace_arrivals(load_trace(trace), 4, 20.0)
    assert all(r["status"] == 200 and r["category"] == "chat" for r in records)
    s = json.loads(summary_path(out).read_text())
    assert s["server"]["offered_rate"] == pytest.approx(20.0)


def _client(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_ignore_eos_through_the_server(up):
    c = _client(up)
    plain = c.completions.create(model="target", prompt=EOS_PROMPT, max_tokens=16, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and 1 <= plain.usage.completion_tokens < 16  # EOS early
    more = c.completions.create(model="target", prompt=EOS_PROMPT, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True})
    assert more.usage.completion_tokens == 16 and more.choices[0].finish_reason == "length"
    assert more.choices[0].text.startswith(plain.choices[0].text) and more.choices[0].text != plain.choices[0].text
    off = c.completions.create(model="target", prompt=EOS_PROMPT, max_tokens=16, temperature=0,
                               extra_body={"ignore_eos": False})
    assert off.choices[0].text == plain.choices[0].text and off.usage.completion_tokens == plain.usage.completion_tokens
    streamed = c.completions.create(model="target", prompt=EOS_PROMPT, max_tokens=16, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == more.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_ignore_eos_must_be_boolean(up):
    with pytest.raises(openai.BadRequestError) as err:
        _client(up).completions.create(model="target", prompt="x = 1", max_tokens=2, extra_body={"ignore_eos": "yes"})
    assert err.value.status_code == 400 and err.value.param == "ignore_eos"
    body = err.value.response.json()
    assert body["error"]["type"] == "invalid_request_error" and "ignore_eos" in body["error"]["message"]


def test_metrics_count_transport_time(up):
    text = httpx.get(f"{up.url}/metrics").text
    assert "# TYPE specserve:iteration_transport_seconds_total counter" in text
    before = parse_counters(text)
    _client(up).completions.create(model="target", prompt=SHORT[1]["prompt"], max_tokens=6, temperature=0)
    after = parse_counters(httpx.get(f"{up.url}/metrics").text)
    d = server_delta(before, after)
    assert d["iteration"]["iterations"] > 0
    assert d["iteration"]["seconds"]["transport"] > 0 and d["iteration"]["seconds"]["target"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_bad_input(up, tmp_path):
    nobody = f"http://127.0.0.1:{_free_port()}"
    out = str(tmp_path / "x.jsonl")
    procs = {
        "nobody": ["--url", nobody, "-n", "2", "--out", out],
        "tier": ["--url", up.url, "-n", "2", "--mix", "critical=1:short,gold=1:short", "--out", out],
        "zero": ["--url", up.url, "--num-requests", "0", "--out", out],
    }
    running = {k: subprocess.Popen([sys.executable, "-m", "specserve.cli", "bench", "--no-progress", *a],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
               for k, a in procs.items()}
    done = {k: (*p.communicate(timeout=120), p.returncode) for k, p in running.items()}
    for k, (stdout, stderr, rc) in done.items():
        assert rc == 2 and stdout == "", (k, stderr)
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("specserve bench: "), (k, stderr)
    assert nobody in done["nobody"][1]
    tier = done["tier"][1]
    assert "gold" in tier and all(name in tier for name in ("critical", "search", "chat"))
    assert "--num-requests must be >= 1" in done["zero"][1]
    assert not Path(out).exists()


def test_cli_accepts_the_servers_tier_aliases(up, tmp_path):
    """OpenAI's tier names the server maps to its classes (priority -> critical, scale -> chat) are valid."""
    out = tmp_path / "alias.jsonl"
    proc = bench_cli("--url", up.url, "-n", "2", "--max-tokens", "2", "--mix", "priority=1:short,scale=1:short",
                     "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    classes = httpx.get(f"{up.url}/v1/slo_classes").json()["classes"]
    by_tier = {r["category"]: r for r in read_records(out)}
    assert by_tier["priority"]["slo_tpot_ms"] == classes["critical"]["tpot_ms"]
    assert by_tier["scale"]["slo_tpot_ms"] == classes["chat"]["tpot_ms"]


def test_bench_rate_schedule_and_refusals_through_slo_admission(up, tmp_path):
    """`--rate-schedule` against a gateway with SLO admission: the requests are the schedule's arrivals,
    a request with an unmeetable TPOT is refused (503) and its record keeps the Retry-After and how fast
    the refusal came; the others are served and carry neither."""
    gw = gateway(up, "none", "--admission", "slo")
    try:
        out = tmp_path / "sched.jsonl"
        proc = bench_cli("--url", gw.address, "--rate-schedule", "1:6,1:0,1:6", "--seed", "3", "--max-tokens", "4",
                         "--ignore-eos", "--mix", "critical=0.5:short:0.01,chat=0.5:short", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        expected = piecewise_arrivals([(1.0, 6.0), (1.0, 0.0), (1.0, 6.0)], 1.0, 3)
        assert [r["scheduled_s"] for r in records] == pytest.approx(expected, abs=1e-12) and len(records) >= 4
        refused = [r for r in records if r["category"] == "critical"]
        served = [r for r in records if r["category"] == "chat"]
        assert refused and served
        for r in refused:
            assert r["status"] == 503 and r["retry_after_s"] >= 1 and 0 < r["status_ms"] < 10_000, r
        for r in served:
            assert r["status"] == 200 and r["retry_after_s"] is None and r["status_ms"] <= r["ttft_ms"], r
    finally:
        gw.stop()
