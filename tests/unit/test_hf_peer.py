"""bench/hf_peer.py (the Hugging Face transformers peer benchmark) runs end to end on the demo pair."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_hf_peer():
    spec = importlib.util.spec_from_file_location("hf_peer", ROOT / "bench" / "hf_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_peer_smoke(tmp_path):
    hf_peer = _load_hf_peer()
    out = tmp_path / "hf_peer.json"
    hf_peer.main(["--prompts", "2", "--max-tokens", "8", "--runs", "1", "--batch-sizes", "1,2", "--out", str(out)])
    report = json.loads(out.read_text())

    meta = report["meta"]
    assert meta["prompts"] == 2 and meta["max_tokens"] == 8 and meta["runs"] == 1
    assert meta["all_lengths_fixed"] is True  # EOS ignored: every request made exactly 8 tokens

    results = report["results"]
    assert set(results) == {"generate", "assisted", "batched"}
    for mode in ("generate", "assisted"):
        assert results[mode]["tokens_per_s"]["median"] > 0
        assert results[mode]["tokens_per_run"] == 2 * 8
    # Greedy assisted generation is lossless: token for token the same as plain greedy generate.
    assert results["assisted"]["identical_to_generate"] is True
    assert results["assisted"]["prompts_differing"] == 0

    by_bs = results["batched"]["by_batch_size"]
    assert set(by_bs) == {"1", "2"}
    assert all(r["tokens_per_s"]["median"] > 0 for r in by_bs.values())
    assert results["batched"]["best"]["batch_size"] in (1, 2)
