"""The gateway's Prometheus exposition: rendered text parsed back gives exact values after known calls."""

from __future__ import annotations

import math
import re

import pytest

from specserve.gateway.metrics import GatewayMetrics, Registry

MODEL = "demo"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def parse(text: str) -> tuple[dict, dict, dict]:
    """(samples {(name, frozenset(labels)): value}, types {name: type}, helps {name: text})."""
    samples, types, helps = {}, {}, {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
            continue
        if line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name not in types, f"{name} typed twice"
            types[name] = kind
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        labels = {}
        rest = match["labels"] or ""
        while rest:
            lm = _LABEL.match(rest)
            assert lm, f"bad labels in {line!r}"
            labels[lm.group(1)] = _unescape(lm.group(2))
            rest = rest[lm.end():]
        key = (match["name"], frozenset(labels.items()))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(match["value"])
    return samples, types, helps


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **{k: str(v) for k, v in labels.items()}}.items()))]


def buckets(samples: dict, name: str, **labels) -> list[tuple[float, float]]:
    want = {"model_name": MODEL, **labels}
    out = []
    for (n, ls), v in samples.items():
        d = dict(ls)
        le = d.pop("le", None)
        if n == f"{name}_bucket" and d == want:
            out.append((float(le), v))
    return sorted(out)


def test_registry_render_format_and_label_escaping():
    reg = Registry()
    c = reg.counter("app:things_total", 'Things "done".\nSecond line \\ backslash.', ("kind",))
    g = reg.gauge("app:level", "A level.")
    c.inc(kind='a "quoted"\nline \\ end')
    c.inc(2.5, kind='a "quoted"\nline \\ end')
    c.inc(kind="plain")
    g.set(-3.5)
    text = reg.render()
    assert '# HELP app:things_total Things "done".\\nSecond line \\\\ backslash.' in text
    assert 'app:things_total{kind="a \\"quoted\\"\\nline \\\\ end"} 3.5' in text.splitlines()
    samples, types, _ = parse(text)
    assert types == {"app:things_total": "counter", "app:level": "gauge"}
    assert samples[("app:things_total", frozenset({("kind", 'a "quoted"\nline \\ end')}))] == 3.5
    assert samples[("app:things_total", frozenset({("kind", "plain")}))] == 1.0
    assert samples[("app:level", frozenset())] == -3.5


def test_registry_rejects_misuse():
    reg = Registry()
    c = reg.counter("x_total", "x", ("a",))
    with pytest.raises(ValueError):
        c.inc(-1, a="1")
    with pytest.raises(ValueError):
        c.inc(b="1")  # wrong label name
    with pytest.raises(ValueError):
        c.inc()  # missing label
    with pytest.raises(ValueError):
        reg.gauge("x_total", "again")
    with pytest.raises(ValueError):
        reg.histogram("h", "h", [1.0, 0.5])
    with pytest.raises(ValueError):
        reg.histogram("h2", "h", [1.0], labelnames=("le",))


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    reg = Registry()
    h = reg.histogram("lat_seconds", "latency", [0.1, 0.5, 1.0], ("route",))
    for v in (0.05, 0.1, 0.3, 0.5, 0.7, 2.0, 100.0):
        h.observe(v, route="/a")
    h.observe(0.2, route="/b")
    samples, types, _ = parse(reg.render())
    assert types == {"lat_seconds": "histogram"}

    def series(route):
        bs = {}
        for (n, ls), v in samples.items():
            d = dict(ls)
            if n == "lat_seconds_bucket" and d["route"] == route:
                bs[d["le"]] = v
        return bs

    assert series("/a") == {"0.1": 2, "0.5": 4, "1.0": 5, "+Inf": 7}
    assert series("/b") == {"0.1": 0, "0.5": 1, "1.0": 1, "+Inf": 1}
    assert samples[("lat_seconds_count", frozenset({("route", "/a")}))] == 7
    assert samples[("lat_seconds_sum", frozenset({("route", "/a")}))] == pytest.approx(103.65)
    # an unlabelled histogram renders at once, all zeros, with the +Inf bucket added once
    reg2 = Registry()
    reg2.histogram("n", "n", [1, 2, math.inf])
    s2, _, _ = parse(reg2.render())
    assert s2[("n_bucket", frozenset({("le", "+Inf")}))] == 0
    assert s2[("n_count", frozenset())] == 0 and s2[("n_sum", frozenset())] == 0
    assert sum(1 for (name, _) in s2 if name == "n_bucket") == 3


def test_gateway_metrics_after_a_known_sequence():
    m = GatewayMetrics(MODEL)
    fresh, types, helps = parse(m.render())
    # everything a dashboard queries exists from the start, at zero
    for name in ("vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total", "vllm:spec_decode_num_drafts_total", "specserve:budget_tokens",
                 "vllm:time_to_first_token_seconds_count", "vllm:iteration_tokens_total_count"):
        assert value(fresh, name) == 0, name
    assert value(fresh, "vllm:request_success_total", finished_reason="stop") == 0
    assert types["vllm:prompt_tokens_total"] == "counter"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    assert types["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == "counter"
    assert all(helps.values())

    m.set_budget(24)
    for _ in range(3):
        m.on_queued()
    m.on_admitted(0.2)
    m.on_admitted(1.2)
    m.on_first_token(0.03)
    m.on_tokens(1, 0.02)  # one token after 20 ms
    m.on_tokens(4, 0.08)  # four tokens after 80 ms: 4 samples of 20 ms
    m.on_tokens(2, 0.5)  # two tokens after 500 ms: 2 samples of 250 ms
    m.on_tokens(0, 1.0)  # nothing
    m.on_iteration(40, 0.010, 0.020, 0.001, drafts=3, draft_tokens=12, accepted=5, accepted_per_pos=[3, 2])
    m.on_iteration(7, 0.0, 0.015, 0.002, drafts=1, draft_tokens=4, accepted=1, accepted_per_pos=[1, 0, 0])
    m.on_finished("stop", 12, 8, 0.9, 0.05, "chat", True)
    m.on_finished("length", 30, 1, 2.0, None, "urgent", False)
    m.on_finished("stop", 5, 3, 0.4, 0.1, "chat", None)
    m.on_error("too_large")
    m.on_error("too_large")
    m.on_error("bad_request")
    m.on_preempted()
    m.set_load(running=2, waiting=5, kv_usage=0.375)
    s, _, _ = parse(m.render())

    assert value(s, "vllm:num_requests_running") == 2
    assert value(s, "vllm:num_requests_waiting") == 5
    assert value(s, "vllm:kv_cache_usage_perc") == 0.375
    assert value(s, "specserve:budget_tokens") == 24
    assert value(s, "specserve:requests_received_total") == 3
    assert value(s, "vllm:prompt_tokens_total") == 47
    assert value(s, "vllm:generation_tokens_total") == 12
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(s, "vllm:num_preemptions_total") == 1
    assert value(s, "specserve:request_errors_total", code="too_large") == 2
    assert value(s, "specserve:request_errors_total", code="bad_request") == 1
    assert value(s, "specserve:request_slo_total", tier="chat", met="true") == 1
    assert value(s, "specserve:request_slo_total", tier="urgent", met="false") == 1
    assert ("specserve:request_slo_total", frozenset({("model_name", MODEL), ("tier", "chat"),
                                                      ("met", "false")})) not in s

    assert value(s, "vllm:request_queue_time_seconds_count") == 2
    assert value(s, "vllm:request_queue_time_seconds_sum") == pytest.approx(1.4)
    assert buckets(s, "vllm:request_queue_time_seconds")[:5] == [(0.3, 1), (0.5, 1), (0.8, 1), (1.0, 1), (1.5, 2)]
    assert value(s, "vllm:time_to_first_token_seconds_count") == 1
    assert value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.03)

    itl = dict(buckets(s, "vllm:inter_token_latency_seconds"))
    assert value(s, "vllm:inter_token_latency_seconds_count") == 7
    assert value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.02 + 0.08 + 0.5)
    assert itl[0.01] == 0 and itl[0.025] == 5 and itl[0.2] == 5 and itl[0.3] == 7 and itl[math.inf] == 7

    assert value(s, "vllm:request_time_per_output_token_seconds_count") == 2  # None is not observed
    assert value(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.15)
    assert value(s, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.3)
    e2e = dict(buckets(s, "vllm:e2e_request_latency_seconds"))
    assert e2e[0.3] == 0 and e2e[0.5] == 1 and e2e[1.0] == 2 and e2e[2.0] == 3 and e2e[math.inf] == 3

    iters = dict(buckets(s, "vllm:iteration_tokens_total"))
    assert iters[1.0] == 0 and iters[8.0] == 1 and iters[32.0] == 1 and iters[64.0] == 2
    assert value(s, "vllm:iteration_tokens_total_sum") == 47
    assert value(s, "specserve:iterations_total") == 2
    assert value(s, "specserve:iteration_draft_seconds_total") == pytest.approx(0.010)
    assert value(s, "specserve:iteration_target_seconds_total") == pytest.approx(0.035)
    assert value(s, "specserve:iteration_schedule_seconds_total") == pytest.approx(0.003)
    assert value(s, "vllm:spec_decode_num_drafts_total") == 4
    assert value(s, "vllm:spec_decode_num_draft_tokens_total") == 16
    assert value(s, "vllm:spec_decode_num_accepted_tokens_total") == 6
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=0) == 4
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=1) == 2
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=2) == 0

    # every histogram series is cumulative, ends in +Inf, and its +Inf bucket equals its count
    for name, kind in types.items():
        if kind != "histogram":
            continue
        bs = buckets(s, name)
        assert bs[-1][0] == math.inf, name
        assert all(a[1] <= b[1] for a, b in zip(bs, bs[1:])), name
        assert bs[-1][1] == value(s, f"{name}_count"), name


def test_model_name_label_is_escaped():
    m = GatewayMetrics('org/"model"\\v1')
    m.on_queued()
    s, _, _ = parse(m.render())
    key = ("specserve:requests_received_total", frozenset({("model_name", 'org/"model"\\v1')}))
    assert s[key] == 1
