"""`specserve bench`: the pure parts (arrivals, mix, records, /metrics parsing) on hand-made inputs, then the real
CLI against one real `specserve up`, with vLLM's `ignore_eos` checked through the official openai client.

The `up` gets a hand-written profile (no 10 s measurement; this file is not about profiling) and two pinned
SLO classes, critical = 1 ms (no request on a CPU can meet it) and chat = 10^6 ms (every request meets it),
so a run always has both met and missed requests and attainment and goodput are never trivially 0 or 1.

Here: the tests that start no process and open no socket; the others are in tests/stack/test_bench.py.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specserve.cli.loadgen.arrivals import (
    gamma_arrivals,
    load_trace,
    parse_rate_schedule,
    piecewise_arrivals,
    poisson_arrivals,
    trace_arrivals,
)
from specserve.cli.loadgen.client import request_body
from specserve.cli.loadgen.records import RequestRecord, percentile, summarize, vllm_tpot_ms
from specserve.cli.loadgen.runner import BenchConfig, arrival_times, format_summary, summary_path
from specserve.cli.loadgen.scrape import parse_counters, server_delta
from specserve.cli.loadgen.workload import (
    DEFAULT_MIX,
    BenchRequest,
    Category,
    build_requests,
    counts_for,
    load_prompts,
    parse_mix,
)


# ================================================================================================ arrivals
def test_gamma_arrivals_seeded_start_at_zero_non_decreasing():
    a = gamma_arrivals(200, 4.0, 0.5, seed=3)
    assert a == gamma_arrivals(200, 4.0, 0.5, seed=3)
    assert a != gamma_arrivals(200, 4.0, 0.5, seed=4)
    assert a[0] == 0.0 and len(a) == 200
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert poisson_arrivals(50, 2.0, seed=9) == gamma_arrivals(50, 2.0, 1.0, seed=9)
    assert gamma_arrivals(0, 1.0) == [] and gamma_arrivals(1, 1.0) == [0.0]


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_mean_gap_and_burstiness():
    rate = 5.0
    poisson = _gaps(gamma_arrivals(20001, rate, 1.0, seed=1))
    mean = statistics.fmean(poisson)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pstdev(poisson) / mean == pytest.approx(1.0, abs=0.05)  # exponential gaps: CV 1
    bursty = _gaps(gamma_arrivals(20001, rate, 0.25, seed=1))
    mean_b = statistics.fmean(bursty)
    assert mean_b == pytest.approx(1 / rate, rel=0.05)  # the same mean rate ...
    assert statistics.pstdev(bursty) / mean_b > 1.7  # ... and CV 1/sqrt(0.25) = 2


def test_gamma_arrivals_infinite_rate_and_errors():
    assert gamma_arrivals(5, math.inf) == [0.0] * 5
    for kw in ({"rate": 0.0}, {"rate": -1.0}, {"rate": math.nan}):
        with pytest.raises(ValueError, match="rate"):
            gamma_arrivals(3, **kw)
    for b in (0.0, -0.5):
        with pytest.raises(ValueError, match="burstiness"):
            gamma_arrivals(3, 1.0, b)
    with pytest.raises(ValueError, match="n must be"):
        gamma_arrivals(-1, 1.0)


def test_load_trace_formats(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("# a comment\n\n3.5\n  1.25  \n\n# 99\n2\n")
    assert load_trace(plain) == [3.5, 1.25, 2.0]
    csv = tmp_path / "t.csv"
    csv.write_text("10.5,req-a,7\n11,req-b\n")
    assert load_trace(csv) == [10.5, 11.0]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 4.0, "x": 1}\n\n{"arrival_time": "5.5"}\n# c\n{"time": 6}\n'
                     '{"timestamp": 1, "time": 99}\n')
    assert load_trace(jsonl) == [4.0, 5.5, 6.0, 1.0]  # timestamp wins over time


def test_load_trace_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1.0\n# ok\nnot-a-number\n")
    with pytest.raises(ValueError, match=rf"{bad}:3: not a timestamp"):
        load_trace(bad)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"timestamp": 1}\n{"when": 2}\n')
    with pytest.raises(ValueError, match=rf"{nofield}:2: .*no timestamp / arrival_time / time field"):
        load_trace(nofield)
    inf = tmp_path / "inf.txt"
    inf.write_text("1\ninf\n")
    with pytest.raises(ValueError, match=rf"{inf}:2: not a finite"):
        load_trace(inf)
    empty = tmp_path / "empty.txt"
    empty.write_text("# only comments\n\n")
    with pytest.raises(ValueError, match="no timestamps"):
        load_trace(empty)


def test_trace_arrivals_sort_shift_cut_rescale():
    times = [7.0, 5.0, 6.0, 9.0, 5.5]
    assert trace_arrivals(times) == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert trace_arrivals(times, n=3) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="5 timestamps, fewer than the 6"):
        trace_arrivals(times, n=6)
    for n, rate in ((5, 2.0), (3, 10.0), (4, 0.3)):
        got = trace_arrivals(times, n=n, rate=rate)
        plain = trace_arrivals(times, n=n)
        assert got[0] == 0.0 and (n - 1) / got[-1] == pytest.approx(rate, rel=1e-12)
        ratio = got[-1] / plain[-1]
        assert got == pytest.approx([t * ratio for t in plain], rel=1e-12)  # one scale: the shape is kept
    assert trace_arrivals([3.0], n=1, rate=5.0) == [0.0]
    with pytest.raises(ValueError, match="rate"):
        trace_arrivals(times, rate=0.0)


def test_arrival_times_of_config(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("2\n4\n5\n")
    assert arrival_times(BenchConfig(num_requests=3, trace=str(trace))) == [0.0, 2.0, 3.0]  # rate inf: as is
    assert arrival_times(BenchConfig(num_requests=3, trace=str(trace), request_rate=4.0)) == pytest.approx(
        [0.0, 1 / 3, 0.5])
    assert arrival_times(BenchConfig(num_requests=4, request_rate=2.0, seed=5)) == gamma_arrivals(4, 2.0, 1.0, 5)
    assert summary_path(Path("/x/run.jsonl")) == Path("/x/run.summary.json")
    burst = BenchConfig(rate_schedule="20:0.5,10:1.5,30:0.5", burstiness=0.5, seed=2)
    assert arrival_times(burst) == piecewise_arrivals([(20, 0.5), (10, 1.5), (30, 0.5)], 0.5, 2)
    with pytest.raises(ValueError, match="exclusive"):
        arrival_times(BenchConfig(rate_schedule="1:1", trace=str(trace)))
    with pytest.raises(ValueError, match="no request"):
        arrival_times(BenchConfig(rate_schedule="0.001:0.001"))


def test_parse_rate_schedule():
    assert parse_rate_schedule("20:0.5, 10:1.5,30:0") == [(20.0, 0.5), (10.0, 1.5), (30.0, 0.0)]
    for bad, message in (("", "no segment"), ("20", "SECONDS:RATE"), ("a:1", "SECONDS:RATE"),
                         ("0:1", "> 0"), ("5:-1", ">= 0"), ("inf:1", "finite"), ("5:nan", "finite")):
        with pytest.raises(ValueError, match=message):
            parse_rate_schedule(bad)


@pytest.mark.parametrize("burstiness", [1.0, 0.3])
def test_piecewise_arrivals_follow_each_segments_rate(burstiness):
    """A burst schedule: each segment holds about duration x rate arrivals (within 5 sigma of the count's
    spread, gamma gaps of shape b have a variance 1/b times Poisson's), none in a zero-rate segment,
    all inside the schedule, sorted and seeded."""
    segments = [(2000.0, 1.0), (500.0, 6.0), (300.0, 0.0), (2000.0, 0.5)]
    a = piecewise_arrivals(segments, burstiness, seed=7)
    assert a == piecewise_arrivals(segments, burstiness, seed=7) != piecewise_arrivals(segments, burstiness, seed=8)
    assert a == sorted(a) and 0 < a[0] and a[-1] < sum(d for d, _ in segments)
    start = 0.0
    for duration, rate in segments:
        count = sum(start <= t < start + duration for t in a)
        expected = duration * rate
        assert abs(count - expected) <= 5 * math.sqrt(expected / burstiness) + 1, (duration, rate, count)
        start += duration
    with pytest.raises(ValueError, match="burstiness"):
        piecewise_arrivals(segments, 0.0)
    with pytest.raises(ValueError, match="segment"):
        piecewise_arrivals([(0.0, 1.0)])
    assert piecewise_arrivals([(5.0, 0.0)]) == []


# ================================================================================================ workload
def test_parse_mix():
    assert parse_mix(DEFAULT_MIX) == [Category("critical", 0.6, "short"), Category("search", 0.2, "long"),
                                      Category("chat", 0.2, "short")]
    assert parse_mix(" gold = 3:short:25 , chat=1:medium,") == [Category("gold", 3.0, "short", 25.0),
                                                                  Category("chat", 1.0, "medium")]


@pytest.mark.parametrize(("spec", "message"), [
    ("critical", "bad category"),
    ("critical=0.6", "bad category"),
    ("critical=x:short", "bad category"),
    ("=0.6:short", "bad category"),
    ("a=1:short:2:3", "bad category"),
    ("a=1:short:fast", "bad category"),
    ("a=1:short:0", "the TPOT > 0"),
    ("a=-0.5:short,b=1:short", "the share must be >= 0"),
    ("a=1:short,a=2:long", "names a tier twice"),
    ("a=0:short,b=0:long", "no category with a positive share"),
    ("", "no category with a positive share"),
])
def test_parse_mix_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(spec)


def test_counts_for_exact_largest_remainder():
    cats = parse_mix(DEFAULT_MIX)
    assert counts_for(cats, 12) == [7, 3, 2]  # 7.2, 2.4, 2.4: the tie goes to the first
    assert counts_for(cats, 10) == [6, 2, 2]
    assert counts_for(cats, 1) == [1, 0, 0]
    assert counts_for(cats, 0) == [0, 0, 0]
    three = [Category(t, 1.0, "short") for t in "abc"]
    assert counts_for(three, 10) == [4, 3, 3]
    assert counts_for(three, 11) == [4, 4, 3]
    uneven = [Category("a", 0.5, "short"), Category("b", 0.3, "short"), Category("c", 0.2, "short")]
    assert counts_for(uneven, 7) == [4, 2, 1]  # 3.5, 2.1, 1.4
    assert counts_for([Category("a", 3, "s"), Category("b", 0, "s"), Category("c", 1, "s")], 5) == [4, 0, 1]
    rng = random.Random(0)
    for _ in range(200):
        shares = [Category(str(i), rng.choice([0.0, rng.random()]), "s") for i in range(rng.randint(1, 6))]
        if not sum(c.share for c in shares):
            continue
        n = rng.randint(0, 300)
        counts = counts_for(shares, n)
        assert sum(counts) == n
        total = sum(c.share for c in shares)
        assert all(abs(k - n * c.share / total) < 1 for k, c in zip(counts, shares))


def test_build_requests_seeded_exact_counts_right_prompts():
    cats = parse_mix("critical=0.5:short:20,search=0.25:long,chat=0.25:medium")
    sets = {w: {r["id"]: r for r in load_prompts(w)} for w in ("short", "long", "medium")}
    a = build_requests(cats, 40, seed=7)
    assert a == build_requests(cats, 40, seed=7)
    b = build_requests(cats, 40, seed=8)
    assert [r.category for r in a] != [r.category for r in b]
    assert Counter(r.category for r in a) == Counter(r.category for r in b) == {"critical": 20, "search": 10,
                                                                                "chat": 10}
    assert [r.index for r in a] == list(range(40))
    workload_of = {c.tier: c.workload for c in cats}
    for r in a:
        assert r.workload == workload_of[r.category]
        row = sets[r.workload][r.prompt_id]
        assert r.prompt == row["prompt"] and r.max_tokens == row["max_tokens"]
        assert r.tpot_ms == (20.0 if r.category == "critical" else None)
    assert len({r.prompt_id for r in a}) > 10  # drawn from the sets, not one row
    fixed = build_requests(cats, 40, seed=7, max_tokens=9)
    assert all(r.max_tokens == 9 for r in fixed)
    assert [(r.category, r.prompt_id) for r in fixed] == [(r.category, r.prompt_id) for r in a]


def test_load_prompts_from_a_file_and_errors(tmp_path):
    with pytest.raises(ValueError, match=r"no prompt set 'nope' \(known: long, medium, short"):
        load_prompts("nope")
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"id": "x", "prompt": "b"}\n')
    assert load_prompts(str(path)) == [{"prompt": "a", "max_tokens": 3, "id": "mine-1"}, {"id": "x", "prompt": "b"}]
    req = build_requests([Category("chat", 1.0, str(path))], 20, seed=0)
    assert {r.prompt_id for r in req} == {"mine-1", "x"}
    assert all(r.max_tokens == (3 if r.prompt_id == "mine-1" else 128) for r in req)  # no max_tokens: 128
    path.write_text('{"prompt": 5}\n')
    with pytest.raises(ValueError, match=rf"{path}:1: a row needs a string 'prompt'"):
        load_prompts(str(path))


def test_request_body():
    req = BenchRequest(0, "critical", "short", "short-0001", "def f():", 16, 25.0)
    body = request_body(req, "target", ignore_eos=True)
    assert body["service_tier"] == "critical" and body["slo"] == {"tpot_ms": 25.0} and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 16 and body["temperature"] == 0.0
    plain = request_body(BenchRequest(0, "chat", "short", "x", "p", 4, None), "target", ignore_eos=False)
    assert "slo" not in plain and "ignore_eos" not in plain
    flexible = request_body(BenchRequest(0, "chat", "short", "x", "p", 4, None), "target", False, best_effort=True)
    assert flexible["slo"] == {"best_effort": True}


# ================================================================================================ records
def test_vllm_tpot_ms():
    assert vllm_tpot_ms(100.0, 400.0, 4) == 100.0
    assert vllm_tpot_ms(50.0, 250.0, 2) == 200.0
    assert vllm_tpot_ms(10.0, 10.0, 1) is None
    assert vllm_tpot_ms(10.0, 10.0, 0) is None


def test_percentile_is_numpys_linear():
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100, 1001):
        xs = rng.exponential(10.0, size).tolist()
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)
    assert percentile([], 50) is None
    assert percentile(iter([3.0, 1.0, 2.0]), 50) == 2.0


def _rec(index, category, slo, tokens=0, ttft=None, latency=None, status=200, error=None, steps=0,
         step_tokens=0) -> RequestRecord:
    tpot = vllm_tpot_ms(ttft, latency, tokens) if ttft is not None else None
    return RequestRecord(index=index, category=category, workload="short", prompt_id=f"p{index}", slo_tpot_ms=slo,
                         slo_ttft_ms=1000.0, scheduled_s=0.0, sent_s=0.0, max_tokens=16, status=status, error=error,
                         ttft_ms=ttft, latency_ms=latency, tpot_ms=tpot, completion_tokens=tokens, steps=steps,
                         step_tokens=step_tokens)


def _records() -> list[RequestRecord]:
    return [
        _rec(0, "critical", 10.0, 11, 100.0, 200.0, steps=4, step_tokens=10),  # TPOT 10 = SLO: met
        _rec(1, "critical", 10.0, 6, 100.0, 160.0, steps=5, step_tokens=5),  # TPOT 12: missed
        _rec(2, "critical", 10.0, 0, status=503, steps=7, step_tokens=100),  # failed (no error text): missed
        _rec(3, "chat", 50.0, 1, 300.0, 300.0),  # one token, no TPOT: met
        _rec(4, "chat", 50.0, 5, 50.0, 250.0, steps=2, step_tokens=4),  # TPOT 50: met
        _rec(5, "chat", 50.0, 0, status=0, error="ClientConnectorError: refused"),  # failed: missed
        _rec(6, "chat", 50.0, 9, 2000.0, 2200.0, status=200, error="the stream ended without a finish_reason"),
    ]


def test_record_met():
    met = [r.tpot_met for r in _records()]
    assert met == [True, False, False, True, True, False, False]
    assert [r.ok for r in _records()] == [True, True, False, True, True, False, False]
    assert [r.slo_met for r in _records()] == met  # every TPOT met here had its TTFT met too


def test_an_slo_is_met_only_when_both_its_ttft_and_its_tpot_are():
    late = _rec(7, "chat", 50.0, 5, 1500.0, 1600.0)  # TPOT 25 <= 50, but the first token 1.5 s late (1 s SLO)
    fast_start_slow_tokens = _rec(8, "chat", 50.0, 5, 100.0, 400.0)  # TTFT met, TPOT 75 > 50
    assert (late.tpot_met, late.ttft_met, late.slo_met) == (True, False, False)
    assert (fast_start_slow_tokens.tpot_met, fast_start_slow_tokens.ttft_met,
            fast_start_slow_tokens.slo_met) == (False, True, False)
    s = summarize([*_records(), late, fast_start_slow_tokens], 2.0)
    assert s["attainment"] == 3 / 9 and s["tpot_attainment"] == 4 / 9 and s["ttft_attainment"] == 5 / 9
    assert s["goodput_tok_s"] == (11 + 1 + 5) / 2.0  # neither new request's tokens: each missed one SLO
    assert s["admitted_attainment"] == 3 / 6 and s["admitted_tpot_attainment"] == 4 / 6
    assert "SLO attainment 33.3 % (TTFT and TPOT; TPOT alone 44.4 %, TTFT alone 55.6 %)" in format_summary(
        {**s, "label": "x", "policy": "none", "duration_s": 2.0, "categories": {}})


def test_summarize():
    s = summarize(_records(), 2.0, {"iteration": {"iterations": 3}})
    assert (s["requests"], s["completed"], s["errors"]) == (7, 4, 3)
    assert s["attainment"] == 3 / 7
    assert s["goodput_tok_s"] == (11 + 1 + 5) / 2.0  # met requests only: not the failed one's 9 tokens
    assert s["throughput_tok_s"] == (11 + 6 + 1 + 5) / 2.0
    assert s["output_tokens"] == 23 and s["request_throughput"] == 2.0
    assert s["ttft_attainment"] == 4 / 7  # the 2000 ms TTFT failed anyway
    assert s["ttft_p50_ms"] == 100.0  # of 50, 100, 100, 300
    assert s["ttft_p99_ms"] == pytest.approx(float(np.percentile([50, 100, 100, 300], 99)))
    assert s["tpot_p50_ms"] == 12.0 and s["tpot_mean_ms"] == pytest.approx(24.0)  # 10, 12, 50
    assert s["tokens_per_step"] == 19 / 11  # completed requests only
    assert s["duration_s"] == 2.0 and s["iteration"] == {"iterations": 3}
    assert list(s["categories"]) == ["critical", "chat"]
    crit, chat = s["categories"]["critical"], s["categories"]["chat"]
    assert (crit["requests"], crit["attainment"], crit["goodput_tok_s"], crit["slo_tpot_ms"]) == (3, 1 / 3, 5.5, 10.0)
    assert (chat["requests"], chat["attainment"], chat["goodput_tok_s"], chat["slo_tpot_ms"]) == (4, 0.5, 3.0, 50.0)
    assert crit["errors"] == 1 and chat["errors"] == 2
    assert s["error_kinds"] == {"HTTP 503": 1, "ClientConnectorError: refused": 1,
                                "the stream ended without a finish_reason": 1}
    assert s["refused"] == 1 and s["best_effort"] == 0
    assert s["admitted_attainment"] == 3 / 4  # among the completed, none of them best effort
    records = _records()
    records[0].best_effort = True  # a met request served best effort leaves the admitted ones
    s = summarize(records, 2.0)
    assert s["best_effort"] == 1 and s["admitted_attainment"] == 2 / 3


def test_summarize_empty_duration_gives_none():
    s = summarize([_rec(0, "chat", 5.0, status=0, error="x")], 0.0)
    assert s["attainment"] == 0.0 and s["goodput_tok_s"] is None and s["tokens_per_step"] is None
    assert s["ttft_p50_ms"] is None and "iteration" not in s


# ================================================================================================ scrape
def _metrics(draft, target, transport, schedule, iterations, drafts, draft_tokens, accepted, pass_s=0.0) -> str:
    m = '{model_name="target"}'
    return f"""specserve:iteration_pass_seconds_total{m} {pass_s}
# HELP specserve:iteration_draft_seconds_total Seconds.
# TYPE specserve:iteration_draft_seconds_total counter
specserve:iteration_draft_seconds_total{m} {draft}
specserve:iteration_target_seconds_total{m} {target}
specserve:iteration_transport_seconds_total{m} {transport}
specserve:iteration_schedule_seconds_total{m} {schedule}
specserve:iterations_total{m} {iterations}
vllm:spec_decode_num_drafts_total{m} {drafts}
vllm:spec_decode_num_draft_tokens_total{m} {draft_tokens}
vllm:spec_decode_num_accepted_tokens_total{m} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="target",position="0"}} 5
"""


def test_parse_counters():
    text = """# HELP vllm:x_total A counter.
# TYPE vllm:x_total counter
vllm:x_total{model_name="a"} 1
vllm:x_total{model_name="b\\\\ \\"q\\""} 2.5

# HELP vllm:lat_seconds A histogram.
# TYPE vllm:lat_seconds histogram
vllm:lat_seconds_bucket{le="0.5",model_name="a"} 1.0
vllm:lat_seconds_bucket{le="+Inf",model_name="a"} 3.0
vllm:lat_seconds_sum{model_name="a"} 2.25
vllm:lat_seconds_count{model_name="a"} 3.0
vllm:hist_total_bucket{le="+Inf"} 2
specserve:y 1e3
"""
    # keyed by each sample's own name (the parser's family names drop a counter's _total), summed over labels
    assert parse_counters(text) == {
        "vllm:x_total": 3.5, "vllm:lat_seconds_bucket": 4.0, "vllm:lat_seconds_sum": 2.25,
        "vllm:lat_seconds_count": 3.0, "vllm:hist_total_bucket": 2.0, "specserve:y": 1000.0}
    assert parse_counters("") == {}
    for bad in ("garbage here\n", "{nolabelname} 4\n", 'vllm:z{model_name="a"} NaN-ish\n', "# TYPE\n"):
        with pytest.raises(ValueError, match="not a Prometheus text exposition"):
            parse_counters(text + bad)


def test_parse_counters_reads_the_gateways_own_exposition():
    from specserve.gateway.obs.metrics import GatewayMetrics
    from tests.support.records import sample_records

    m = GatewayMetrics('org/"m"\\v1')
    before = parse_counters(m.render())
    assert before["specserve:iterations_total"] == 0 and before["vllm:request_success_total"] == 0
    for record in sample_records():
        m.on_iteration(record)
    m.on_finished("stop", 12, 8, 0.9, 0.05, "chat", True)
    m.on_finished("length", 3, 1, 2.0, None, "chat", False)
    after = parse_counters(m.render())
    assert after["vllm:request_success_total"] == 2  # over finished_reason
    assert after["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 6  # over position
    assert after["vllm:iteration_tokens_total_sum"] == 47 and after["vllm:iteration_tokens_total_count"] == 2
    assert not any(name.endswith("_created") for name in after)
    d = server_delta(before, after)
    assert d["iteration"]["iterations"] == 2
    assert d["iteration"]["seconds"] == pytest.approx(
        {"draft": 0.010, "target": 0.035, "transport": 0.004, "schedule": 0.003})
    assert d["iteration"]["pass_seconds"] == pytest.approx(0.0295)
    assert d["acceptance_rate"] == 6 / 16 and d["mean_acceptance_length"] == 1 + 6 / 4


def test_server_delta():
    before = parse_counters(_metrics(1.0, 4.0, 0.5, 0.5, 100, 50, 200, 80))
    after = parse_counters(_metrics(2.0, 7.0, 1.0, 1.0, 200, 90, 360, 140))
    d = server_delta(before, after)
    it = d["iteration"]
    assert it["iterations"] == 100
    assert it["seconds"] == {"draft": 1.0, "target": 3.0, "transport": 0.5, "schedule": 0.5}
    assert it["share"] == pytest.approx({"draft": 0.2, "target": 0.6, "transport": 0.1, "schedule": 0.1})
    assert sum(it["share"].values()) == pytest.approx(1.0, abs=1e-12)
    assert it["mean_ms"] == pytest.approx(50.0)  # 5 s over 100 iterations
    assert d["acceptance_rate"] == 60 / 160
    assert d["mean_acceptance_length"] == 1 + 60 / 40
    assert d["draft_tokens_per_iteration"] == 1.6
    idle = server_delta(after, after)
    assert idle["iteration"]["iterations"] == 0 and idle["iteration"]["mean_ms"] is None
    assert idle["iteration"]["share"] == dict.fromkeys(("draft", "target", "transport", "schedule"))
    assert idle["acceptance_rate"] is None and idle["mean_acceptance_length"] is None


def test_the_step_overhead_bench_counts_the_target_services_own_work_as_the_stacks():
    from bench.step_overhead import iteration_split

    before = parse_counters(_metrics(1.0, 4.0, 0.5, 0.5, 100, 50, 200, 80, pass_s=3.0))
    after = parse_counters(_metrics(2.0, 7.0, 1.0, 1.0, 200, 90, 360, 140, pass_s=5.5))
    split = iteration_split(server_delta(before, after)["iteration"])
    assert split["iteration_ms"] == pytest.approx(50.0)
    assert split["target_ms"] == pytest.approx(25.0)  # the model pass alone: 2.5 s over 100 iterations
    assert split["target_service_ms"] == pytest.approx(5.0)  # the rest of the target's 30 ms an iteration
    assert split["stack_ms"] == pytest.approx(25.0)  # wall less the pass: draft, transport, schedule, the service's own
    walled = iteration_split(server_delta(before, after)["iteration"], wall_s=6.0)  # the window's wall time
    assert walled["iteration_ms"] == pytest.approx(60.0) and walled["counted_ms"] == pytest.approx(50.0)
    assert walled["stack_ms"] == pytest.approx(35.0)  # what the counters leave out (the loop's turns) counts


def test_the_stack_ab_bench_swaps_nothing_for_head_and_groups_rounds_by_revision_level_and_flag():
    from bench.stack_ab import summary, swapped_files

    assert swapped_files(["HEAD"]) == []  # HEAD against itself: no file to check out
    rows = [{"rev": rev, "inflight": 64, "flag": "off", "round": r, "stack_ms": ms, "target_service_ms": 0.5,
             "target_ms": 4.0, "tokens_per_s": 9000.0 + r} for rev, r, ms in
            (("a1", 1, 3.0), ("b2", 1, 2.0), ("b2", 2, 2.6), ("a1", 2, 3.2), ("a1", 3, 2.9), ("b2", 3, 2.4))]
    s = summary(rows)
    assert list(s) == ["a1 @64 off", "b2 @64 off"]
    assert s["a1 @64 off"]["stack_ms"] == {"median": 3.0, "min": 2.9, "max": 3.2}
    assert s["b2 @64 off"]["stack_ms"]["median"] == 2.4 and s["b2 @64 off"]["tokens_per_s"]["max"] == 9003.0


def test_format_summary_lists_categories_and_split():
    before = parse_counters(_metrics(1.0, 4.0, 0.5, 0.5, 100, 50, 200, 80))
    after = parse_counters(_metrics(2.0, 7.0, 1.0, 1.0, 200, 90, 360, 140))
    s = summarize(_records(), 2.0, server_delta(before, after)) | {"label": "my-run", "policy": "adaserve"}
    text = format_summary(s)
    assert "label my-run" in text and "requests 7" in text and "errors 3" in text
    assert "SLO attainment 42.9 % (TTFT and TPOT" in text and "goodput 8.5 tok/s" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["critical"], ["chat"])}
    assert rows["critical"][1:4] == ["10.0", "3", "33.3"] and rows["critical"][4] == "5.5"
    assert rows["chat"][1:4] == ["50.0", "4", "50.0"] and rows["chat"][4] == "3.0"
    assert "iterations 100" in text and "target 60.0 %" in text and "transport 10.0 %" in text
    assert "error x1: HTTP 503" in text
