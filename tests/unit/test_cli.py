"""The `specserve` console script, run as a real process.

Here: the tests that start no process and open no socket; the others are in tests/service/test_cli.py.
"""

from __future__ import annotations

from pathlib import Path


def test_service_flags_fall_back_to_environment_variables(monkeypatch):
    from specserve.cli.main import build_parser
    from specserve.draft.config import DraftConfig

    monkeypatch.setenv("SPECSERVE_DRAFT_KV_BLOCKS", "77")
    monkeypatch.setenv("SPECSERVE_DRAFT_PORT", "9123")
    config = DraftConfig.from_args(build_parser().parse_args(["draft", "--threads", "1"]))
    assert (config.kv_blocks, config.port, config.threads, config.address) == (77, 9123, 1, "127.0.0.1:9123")
    config = DraftConfig.from_args(build_parser().parse_args(["draft", "--unix-socket", "/tmp/d.sock"]))
    assert config.address == "unix:/tmp/d.sock" and config.model.endswith("models/draft")


def test_up_pairs_a_target_with_its_own_draft_by_default():
    """Without --draft-model, a named model gets the draft its entry names (never the demo draft, whose
    vocabulary is not its own), and any other target the bundled demo draft."""
    from specserve.cli.up import default_draft
    from specserve.draft.ngram import NGRAM
    from specserve.shared.runtime.model_store import MODELS, NAMED

    assert default_draft("/some/target") == str(MODELS / "draft")
    assert default_draft("demo") == str(MODELS / "draft")
    for name in NAMED:
        draft = default_draft(name)
        assert draft == NGRAM or (Path(draft).parent == MODELS and (Path(draft) / "config.json").is_file()), draft
        assert draft != str(MODELS / "draft")
