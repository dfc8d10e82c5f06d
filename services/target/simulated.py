"""The simulated target (`specserve target --simulate SPEC`): the real TargetEngine on a
SimulatedRunner, whose pass takes the preset's modelled time and yields the true next token at
every node, and the acceptance rule that follows the true tokens (shared/simulate/)."""

from __future__ import annotations

from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.simulate.acceptance import accept_choices
from specserve.shared.simulate.preset import load_preset
from specserve.shared.simulate.runner import SimulatedRunner
from specserve.shared.simulate.text import load_corpus
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine


def simulated_engine(config: TargetConfig) -> TargetEngine:
    """config.model names the tokenizer's model directory: its config.json gives the vocabulary
    (the bad-token checks); no weights are read."""
    preset = load_preset(config.simulate or "")
    vocab_size = ModelConfig.from_dir(config.model).vocab_size
    truth = load_corpus(preset.corpus, preset.tokenizer, preset.seed)
    runner = SimulatedRunner(config.kv_blocks, config.block_size, vocab_size, preset.target, truth)
    return TargetEngine(config, runner=runner, accept=accept_choices)
