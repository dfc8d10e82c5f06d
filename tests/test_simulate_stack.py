"""A simulated stack (`specserve up --simulate cpu-demo`) passes the gateway's own API, bad-input,
losslessness and crash tests: they are test_gateway.py's functions, run here against this module's
`up` fixture. The reference output is the simulation's true continuation of each prompt, which any
policy must emit exactly (greedy). Also: N simulated replicas start and serve, and a bad or missing
spec exits 2 with one line (`--simulate ''` means no simulation,
as for every optional setting: shared/process/settings.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from specserve.shared.simulate.preset import load_preset
from specserve.shared.simulate.text import load_corpus
from tests.support.fixtures import fresh_profile, start_up
from tests.support.gateway import MAX_TOKENS, PROMPTS, TARGET, aclient, up_profile
from tests.support.procs import Up
from tests.test_gateway import (  # noqa: F401  (tests, not helpers: collected here, against the simulated `up`)
    test_32_concurrent_streams,
    test_bad_requests_get_400_while_others_continue,
    test_chat_non_streaming_and_completion_streaming_agree,
    test_chat_streaming_event_order,
    test_completions_non_streaming,
    test_disconnect_frees_kv_everywhere,
    test_draft_crash_is_survived_losslessly,
    test_greedy_identical_across_policies,
    test_models_health_metrics,
    test_stop_strings_and_seeded_sampling,
    test_tight_slo_gets_larger_trees,
)

PRESET = "cpu-demo"


@pytest.fixture(scope="module")
def up(request, tmp_path_factory):
    profile = fresh_profile(tmp_path_factory)
    server = start_up(request, "--simulate", PRESET, "--policy", "adaserve", profile=profile)
    assert profile.is_file(), "the gateway did not profile the simulated target on first start"
    return server


@pytest.fixture(scope="module")
def reference() -> list[str]:
    return simulated_greedy(PROMPTS, MAX_TOKENS)


def simulated_greedy(prompts: list[str], max_tokens: int) -> list[str]:
    """The simulated target's output: the true continuation of each prompt (no EOS in the corpus)."""
    tok = AutoTokenizer.from_pretrained(TARGET)
    preset = load_preset(PRESET)
    truth = load_corpus(preset.corpus, preset.tokenizer, preset.seed)
    return [tok.decode(truth.continuation(tok(p)["input_ids"], max_tokens), skip_special_tokens=True)
            for p in prompts]


def test_n_simulated_replicas_start_and_serve(up, tmp_path):
    """Three simulated target replicas behind one gateway: every one serves, output is the truth."""
    server = Up("--simulate", PRESET, "--targets", "3", "--profile", up_profile(up), "--", "--budget", "24")
    try:
        assert [r["up"] for r in httpx.get(f"{server.url}/health").json()["replicas"]] == [True] * 3

        async def run():
            c = aclient(server.url)
            out = await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=MAX_TOKENS,
                                                              temperature=0) for p in PROMPTS * 2])
            await c.close()
            return out

        results = asyncio.run(run())
        assert [r.choices[0].text for r in results] == simulated_greedy(PROMPTS, MAX_TOKENS) * 2
        assert {r.model_extra["specserve"]["replica"] for r in results} == {0, 1, 2}
    finally:
        assert server.interrupt() == 0


@pytest.mark.parametrize("command,spec,words", [
    (["target"], "no-such-preset", "unknown preset"),
    (["draft"], "missing.toml", "no such preset file"),
    (["up", "--port", "0"], "bad/missing.toml", "no such preset file"),
])
def test_bad_or_missing_spec_exits_2_with_one_line(command, spec, words):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", *command, "--simulate", spec],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
