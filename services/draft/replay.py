"""The replay draft (`specserve draft --model replay:FILE`, `specserve up --draft-model replay:FILE`): a
benchmark tool that drafts at a known acceptance, on any target, random weights included.

FILE is a recording (JSON): `{"alpha": 0.8, "seed": 0, "records": [{"prompt": [ids], "output": [ids]}]}`,
each output the target's own greedy continuation of its prompt (bench/replay_record.py writes one).
For a request whose history starts with a recorded prompt, the draft proposes the recorded output from
the request's position on, as a chain: the token at output position q is the recorded one with
probability alpha and another token otherwise, drawn once per (record, q) from the seed, so a run is
reproducible and a greedy chain is accepted up to its first replaced token (tokens per pass
1 + alpha + ... + alpha^d on average). A node's path probability is alpha to its depth. A request
that matches no record, or has left its record (a sampled output), gets a root-only tree.

`ReplayDraftEngine` is the n-gram draft's engine (no weights, no KV) with this tree source.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.draft.beam import BeamRequest, BeamTree
from specserve.draft.config import DraftConfig
from specserve.draft.ngram import NgramDraftEngine

REPLAY = "replay:"  # the --model prefix that selects this draft; the recording's path follows


def is_replay(model: str) -> bool:
    return model.startswith(REPLAY)


@dataclass(frozen=True, slots=True)
class Recording:
    alpha: float  # probability that a proposed token is the recorded one
    seed: int
    records: list[tuple[list[int], list[int]]]  # (prompt, greedy output)

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        data = json.loads(Path(path).read_text())
        alpha = float(data["alpha"])
        if not 0 < alpha <= 1:
            raise ValueError(f"{path}: alpha must be in (0, 1], got {alpha}")
        records = [(list(map(int, r["prompt"])), list(map(int, r["output"]))) for r in data["records"]]
        if any(not prompt for prompt, _ in records):
            raise ValueError(f"{path}: every record needs a non-empty prompt")
        return cls(alpha, int(data.get("seed", 0)), records)

    def kept(self, record: int, length: int) -> np.ndarray:
        """[length] bool: whether output position q of `record` is proposed as recorded (seeded per record)."""
        digest = hashlib.sha256(f"{self.seed}:{record}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return rng.random(length) < self.alpha


class ReplayDraftEngine(NgramDraftEngine):
    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.recording = Recording.load(config.model.removeprefix(REPLAY))
        self._kept = [self.recording.kept(i, len(out)) for i, (_, out) in enumerate(self.recording.records)]
        self._match: dict[str, int | None] = {}  # request -> its record (None: none matches)

    def _record_of(self, rid: str, history: list[int]) -> int | None:
        if rid not in self._match:
            self._match[rid] = next((i for i, (prompt, _) in enumerate(self.recording.records)
                                     if history[:len(prompt)] == prompt), None)
        return self._match[rid]

    def _beam_search(self, beams: list[BeamRequest]) -> tuple[dict[str, BeamTree], int]:
        return {r.rid: self._chain(r.rid, self.requests[r.rid].tokens, r.depth) for r in beams}, 0

    def _chain(self, rid: str, history: list[int], depth: int) -> BeamTree:
        tree = BeamTree([int(history[-1])], [-1], [0.0])
        index = self._record_of(rid, history)
        if index is None:
            return tree
        prompt, output = self.recording.records[index]
        pos = len(history) - len(prompt)  # output tokens so far: the chain proposes output[pos:]
        if history[len(prompt):] != output[:pos]:
            return tree  # the request left its record (sampled): nothing to replay
        log_alpha = math.log(self.recording.alpha)
        for k, q in enumerate(range(pos, min(pos + depth, len(output)))):
            token = output[q] if self._kept[index][q] else _other(output[q])
            tree.tokens.append(token)
            tree.parents.append(k)  # node k is the previous node of the chain (the root for k = 0)
            tree.logp.append((k + 1) * log_alpha)
        return tree

    def release(self, rid: str) -> bool:
        self._match.pop(rid, None)
        return super().release(rid)


def record_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, alpha: float, seed: int,
                  out: Path, stop_at_eos: bool = True) -> None:
    """Write a recording: the target's greedy outputs on `prompts` (at most `max_tokens`, ending at its EOS
    unless not `stop_at_eos`: for clients that send `ignore_eos`), run in this process on the pass the target
    service runs (its default kernels), which gives every token the logits it gets in any batch."""
    from specserve.shared.runtime.generate import generate
    from specserve.shared.runtime.loader import load_model
    from specserve.shared.runtime.model_config import ModelConfig
    from specserve.shared.runtime.runner import ModelRunner

    runner = ModelRunner(load_model(model_dir), num_blocks=sum(len(p) + max_tokens for p in prompts) // 16 + 16)
    eos = set(ModelConfig.from_dir(model_dir).eos_token_ids) if stop_at_eos else set()
    outputs = generate(runner, {str(i): p for i, p in enumerate(prompts)}, max_tokens, stop_ids=eos)
    records = [{"prompt": p, "output": outputs[str(i)]} for i, p in enumerate(prompts)]
    out.write_text(json.dumps({"alpha": alpha, "seed": seed, "records": records}))
    Recording.load(out)  # the draft service reads it back the same way


def _other(token: int) -> int:
    """A token id other than `token`, within any vocabulary that holds `token`."""
    return token - 1 if token > 0 else token + 1
