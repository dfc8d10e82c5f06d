"""compose.yaml, checked by a real compose implementation and run as plain processes.

- `docker-compose config` (or `docker compose config`) accepts compose.yaml and the GPU override,
  and refuses a broken copy (so the check can fail);
- the `secret`, `draft`, two `target` replicas and `gateway` services run with their exact
  commands and environment (tests/support/compose.py says what differs from a container and why);
  the gateway finds the target replicas by resolving the name `target` (`--discover-targets`,
  here through its hosts file, in containers through compose's DNS):
  - a replica that appears in the name's addresses joins, and requests are spread over both;
  - the official openai client's greedy output equals transformers';
  - a replica whose address vanishes while it serves requests is drained: its requests finish
    with the same greedy output, it is then dropped and holds no request and no KV block (its own
    /metrics), and later requests go to the other replica only.

Here: the tests that start no process and open no socket; the others are in tests/stack/test_compose.py.
"""

from __future__ import annotations

import yaml

from tests.support.compose import COMPOSE, known_variables
from tests.support.promql import metric_names

# PromQL words that are not metric names (functions, aggregations, keywords) and Prometheus's own `up`.




def test_metric_name_parser():
    assert metric_names('histogram_quantile(0.99, sum by (le, tier) (rate(a:b_bucket{x="y"}[5m])))') == {"a:b_bucket"}
    assert metric_names('sum by (tier) (rate(c_total{met="true"}[1m])) / sum(rate(d[1m])) > 0.9') == {"c_total", "d"}


def test_compose_names_only_real_settings():
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, spec in compose["services"].items():
        unknown = {k for k in (spec.get("environment") or {}) if k.startswith("SPECSERVE_")} - known_variables()
        assert not unknown, (name, unknown)
