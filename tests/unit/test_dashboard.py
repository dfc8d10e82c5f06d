"""Every panel of the bundled Grafana dashboard has data under a plain `specserve up` (issue 33).

- `specserve up` gives the draft and every target replica a Prometheus /metrics port, by default the
  ports compose.yaml gives them, and deploy/prometheus/local.yml scrapes exactly those (with the
  gateway on up's default --port), under the job names of the shipped prometheus.yml;
- the stack test runs `specserve up` on the bundled demo models (its /metrics on free ports, read
  from its `metrics <name> <url>` lines), the real Prometheus binary with local.yml's jobs and rules
  pointed at those ports, and evaluates every expression of deploy/grafana/dashboards/specserve.json
  through Prometheus' HTTP API: each returns a series before any request (the labelled counters
  and histograms exist at 0 from the start), and a series with a finite value after a little load
  through the official openai client (streaming and not). Grafana's variables are filled in as
  Grafana would: `$__rate_interval` and its kin with a window that covers the whole run, a
  dashboard template variable with "All" (`.*`).

The stack runs `--policy chain:4`, which drafts at every decode step: the default (`joint`) drafts
only where that buys SLO goodput, and at this light load it made no draft call at all in 2 of 4
runs here, which leaves the speculation panels (acceptance rate, accepted length, the draft's call time)
at NaN, a series without a value. That is the policy's choice, not a missing metric.

Here: the tests that start no process and open no socket; the others are in tests/stack/test_dashboard.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from specserve.cli.up import SERVICE_HOST, UpConfig, add_flags

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy/prometheus"
LOCAL = PROMETHEUS_DIR / "local.yml"


def up_defaults() -> UpConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return UpConfig.from_args(parser.parse_args([]), environ={})


# ---- the configuration alone ---------------------------------------------------------------------
def test_the_local_prometheus_config_scrapes_ups_default_ports():
    """local.yml's targets are where a plain `specserve up` serves /metrics, and compose's metrics ports
    are up's defaults too; its job names are prometheus.yml's (the dashboard selects on them)."""
    defaults = up_defaults()
    base = defaults.metrics_port
    assert base is not None
    local = yaml.safe_load(LOCAL.read_text())
    jobs = {j["job_name"]: [t for c in j["static_configs"] for t in c["targets"]] for j in local["scrape_configs"]}
    assert jobs == {"gateway": [f"{SERVICE_HOST}:{defaults.port}"], "draft": [f"{SERVICE_HOST}:{base}"],
                    "target": [f"{SERVICE_HOST}:{base + 1}"]}
    shipped = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert [j["job_name"] for j in shipped["scrape_configs"]] == list(jobs)
    assert local["rule_files"] == shipped["rule_files"]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert compose["draft"]["environment"]["SPECSERVE_DRAFT_METRICS_PORT"] == str(base)
    assert compose["target"]["environment"]["SPECSERVE_TARGET_METRICS_PORT"] == str(base + 1)
    ports = {j["job_name"]: [c["port"] for c in j.get("dns_sd_configs", [])] for j in shipped["scrape_configs"]}
    assert ports["draft"] == [base] and ports["target"] == [base + 1]
