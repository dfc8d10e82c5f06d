"""The simulated draft (`specserve draft --simulate SPEC`): the real DraftEngine (history, checks,
KV catch-up and its block accounting, offload and reload) on a SimulatedRunner, with the beam
search replaced by the preset's acceptance model (shared/simulate/acceptance.py). The beam's
passes still run through the runner, one batched pass per step as in services/draft/beam.py, so
they take KV blocks and the modelled time of n x w nodes."""

from __future__ import annotations

import math
import random

import torch

from specserve.draft.beam import BeamRequest, BeamTree
from specserve.draft.config import DraftConfig
from specserve.draft.engine import DraftEngine
from specserve.shared.runtime.batch import DraftNodes
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.simulate.preset import Preset, load_preset
from specserve.shared.simulate.runner import SimulatedRunner
from specserve.shared.simulate.text import TruthText, _mix, load_corpus
from specserve.shared.spec.token_tree import depths
from specserve.shared.wire.messages import Offload, Reload, TransitionReply


class SimulatedDraftEngine(DraftEngine):
    def __init__(self, config: DraftConfig, preset: Preset, vocab_size: int, truth: TruthText):
        self._init_state(config)  # DraftEngine.__init__ would load a model
        self.preset, self.truth = preset, truth
        self.vocab_size = vocab_size
        self._new_pool()

    def _new_pool(self) -> None:
        self.runner = SimulatedRunner(self.config.kv_blocks, self.config.block_size, self.vocab_size,
                                      self.preset.draft)
        self.static_step = None

    def _beam_search(self, beams: list[BeamRequest]) -> tuple[dict[str, BeamTree], int]:
        trees: dict[str, BeamTree] = {}
        layers: dict[str, list[list[int]]] = {}
        for r in beams:
            seq = self.requests[r.rid].tokens
            truth = self.truth.continuation(seq, r.depth)
            context = [seq[-2] if len(seq) >= 2 else -1, seq[-1], *truth]  # context[k - 1], context[k]: before depth k
            pos = len(seq)
            # Reproducible: the draft's guesses depend on the committed text and the tree's shape only.
            rng = random.Random(_mix(self.preset.seed, pos, context[0], context[1], r.depth, r.width))

            def wrong(k: int, _node: int, count: int, context: list[int] = context, pos: int = pos,
                      truth: list[int] = truth) -> list[int]:
                return self.truth.alternatives(context[k - 1], context[k], pos + k - 1, truth[k - 1], count)

            tokens, parents, probs = self.preset.acceptance.propose(rng, truth, wrong, r.depth, r.width, r.root)
            trees[r.rid] = BeamTree(tokens, parents, [math.log(max(p, 1e-300)) for p in probs])
            level = depths(parents)
            layers[r.rid] = [[i for i in range(len(tokens)) if level[i] == k] for k in range(r.depth + 1)]
        forwards = 0
        runner = self._pool()
        try:
            for step in range(2, max((r.depth for r in beams), default=0) + 1):
                entries = []
                for r in beams:
                    if r.depth < step:
                        continue
                    tree, layer = trees[r.rid], layers[r.rid][step - 1]
                    if layer:
                        entries.append(DraftNodes(r.rid, [tree.tokens[i] for i in layer],
                                                  [tree.parents[i] - 1 for i in layer], logits_at=()))
                if entries:
                    runner.forward(entries)
                    forwards += 1
        finally:
            for r in beams:
                if runner.has_pending(r.rid):
                    runner.discard_tree(r.rid)
        return trees, forwards

    def offload(self, _msg: Offload | None = None,
                _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        """No weights to move: the KV pool goes, the histories stay (requests catch up after reload)."""
        if self.runner is not None:
            self.runner = None
            for req in self.requests.values():
                req.synced = 0
        return self._transition(0.0, 0, 0), None

    def reload(self, _msg: Reload | None = None,
               _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        if self.runner is None:
            self._new_pool()
        return self._transition(0.0, 0, 0), None


def simulated_engine(config: DraftConfig) -> SimulatedDraftEngine:
    """config.model names a model directory for its config.json (the vocabulary); no weights are read."""
    preset = load_preset(config.simulate or "")
    vocab_size = ModelConfig.from_dir(config.model).vocab_size
    return SimulatedDraftEngine(config, preset, vocab_size, load_corpus(preset.corpus, preset.tokenizer, preset.seed))
