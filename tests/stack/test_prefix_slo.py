"""bench/prefix_slo.py on the demo pair, tiny: three `specserve up --targets 2` stacks (prefix caching on,
off, and FIFO admission with it off), one round at one rate of 2-turn conversations. Every turn ends
(served or refused, none lost), every KV block is free after each point, only the caching arm reports
cached tokens, and the JSON has the shape the report reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import prefix_slo  # noqa: E402


@pytest.mark.timeout(600)
def test_a_tiny_run_ends_every_turn_and_writes_its_summary(suite_profile, tmp_path):
    out = tmp_path / "prefix_slo.json"
    code = prefix_slo.main(["--model", "demo", "--rates", "1", "--rounds", "1", "--duration-s", "4", "--turns", "2",
                            "--answer-tokens", "8", "--system-tokens", "48", "--think-s", "0", "--quiet-s", "0",
                            "--profile", str(suite_profile), "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0
    points = result["points"]
    assert sorted(p["arm"] for p in points) == sorted(prefix_slo.ARMS)
    for p in points:
        assert p["planned"] == 2 * p["conversations"] == p["requests"] == len(p["records"]) > 0, p["arm"]
        assert p["lost"] == 0 and p["failed"] == 0 and p["idle_after"], p
        assert sum(p["outcomes"].values()) == p["requests"]
        assert sorted((r["conversation"], r["turn"]) for r in p["records"]) == [
            (c, t) for c in range(p["conversations"]) for t in (1, 2)]
        assert all(r["outcome"] in ("slo_met", "slo_missed", "best_effort", "refused") for r in p["records"])
    cached = {p["arm"]: p["cached_tokens"] for p in points}
    assert cached["on"] > 0 and cached["off"] == cached["fifo"] == 0  # the second turn re-sends the first
    assert result["calibration"]["base_ttft_ms"] > 0 and result["calibration"]["base_tpot_ms"] > 0
    assert set(result["slo"]) == {"interactive", "chat"}
    summary = result["summary"]
    assert summary["lost"] == 0 and summary["all_idle_after"] and summary["fifo_50_rate"] == 1.0
    assert set(summary["arms"]) == set(prefix_slo.ARMS) and set(summary["ratio_on_off"]) == {"1"}
    assert summary["arms"]["on"]["1"]["attainment"] is not None
