"""The soak (bench/soak.py) for five minutes on the demo pair: `specserve up --targets 2 -- --frontends 2`
under the SLO mix at about 70 % of its measured capacity, with the six faults (a burst of 150, a
client that stops reading, a client that disconnects mid-stream, SIGKILL of the draft, of a target
replica and of a front end), and every rule of bench/soak_rules.py: no request lost that a fault did
not own, no process's RSS growing past 2 MB per 10 minutes after the warm-up, descriptors, threads,
event-loop tasks and KV blocks back to their idle values after every fault and at the end, every
gauge read and every fault done. Two rules are relaxed, and the output says so: the TPOT rule is
reported, not enforced (`--relax-tpot`: five minutes on a shared CI machine do not make a latency
trend), and RSS may grow by 20 MB per 10 minutes, not 2: over the four minutes after the warm-up an
allocator's one-off step at a peak (a target replica measured 976.3 -> 978.4 MB across the burst and
the long stream: 5.6 MB per 10 minutes over 150 s) extrapolates to a steep slope; five minutes catch
a gross leak, the hour-long run (docs/reliability.md) holds the 2 MB.

The gateway cuts a stalled stream after 5 s with 4 KiB buffers here (its defaults, 30 s and 64 KiB,
would take longer than the run allows to fill and cut), so the slow client is cut within the run.
About six minutes in all (the suite's budget allows one such test).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import soak  # noqa: E402


@pytest.mark.timeout(1200)
def test_five_minute_soak_loses_nothing_and_grows_nothing(suite_profile, tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--minutes", "5", "--model", "demo", "--capacity-s", "15", "--sample-s", "10",
                      "--grace-s", "90", "--relax-tpot", "--rss-mb-per-10min", "20", "--profile", str(suite_profile),
                      "--out", str(out), "--gateway-args", "--stream-buffer-bytes 4096 --stream-stall-s 5"])
    result = json.loads(out.read_text())
    rules = result["rules"]
    assert code == 0, json.dumps({k: v for k, v in rules.items() if not v["ok"]}, indent=1, default=str)[:8000]
    assert [f["name"] for f in result["faults"]] == list(soak.FAULTS)
    assert rules["lost"]["completed"] > 0 and rules["lost"]["lost"] == 0
    assert all(c["idle"] for c in result["checkpoints"]) and result["checkpoints"][-1]["name"] == "end"
    assert out.with_suffix(".png").is_file()
