"""The target applies structured output's masks (in-process TargetEngine on the demo target): the first
token of a masked prompt and every node of a masked tree are chosen among the allowed tokens alone, under
greedy and under sampling; an unmasked request beside a masked one gets what it gets alone; with prompt
logprobs the mask limits the prompt's last row alone, and logprobs stay the model's own; a
"token_masks" tensor that disagrees with the entries refuses the call."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve.shared.host.service_base import BadCall
from specserve.shared.spec import token_mask
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

VOCAB = 4096
PROMPT = [72, 400, 1201, 33, 9, 870, 15, 3001, 77, 260, 41]
_steps = itertools.count(1)


@pytest.fixture(scope="module")
def target() -> TargetEngine:
    return TargetEngine(TargetConfig(kv_blocks=64, threads=1))


def only(*tokens: int) -> torch.Tensor:
    """One mask row per token: that token alone allowed."""
    allowed = torch.zeros(len(tokens), VOCAB, dtype=torch.bool)
    for i, t in enumerate(tokens):
        allowed[i, t] = True
    return token_mask.pack(allowed)


def prefill(target: TargetEngine, rids: list[str], spec: SamplingSpec, masks: dict[str, torch.Tensor]) -> list[int]:
    entries = [PrefillEntry(rid, next(_steps), 0, len(PROMPT), True, spec, masked=rid in masks) for rid in rids]
    tensors = {"prefill_tokens": torch.tensor(PROMPT * len(rids), dtype=torch.int32)}
    if masks:
        tensors["token_masks"] = torch.cat([masks[rid] for rid in rids if rid in masks])
    reply, out = target.forward(Forward(entries), tensors)
    assert all(r.error is None for r in reply.results), reply.results
    return out["tokens"].tolist()


def verify(target: TargetEngine, rid: str, root: int, chain: list[int], masks: torch.Tensor | None) -> list[int]:
    tokens = [root, *chain]
    entry = VerifyEntry(rid, next(_steps), len(PROMPT) + 1, len(tokens), masked=masks is not None)
    tensors = {"tree_tokens": torch.tensor(tokens, dtype=torch.int32),
               "tree_parents": torch.tensor(list(range(-1, len(chain))), dtype=torch.int32)}
    if masks is not None:
        tensors["token_masks"] = masks
    reply, out = target.forward(Forward(verify=[entry]), tensors)
    assert reply.results[0].error is None, reply.results
    return out["tokens"].tolist()


@pytest.mark.parametrize("spec", [SamplingSpec(0.0), SamplingSpec(1.0, seed=5)], ids=["greedy", "sampled"])
def test_masked_first_token_and_tree_follow_the_masks(target, spec):
    free = prefill(target, ["free"], SamplingSpec(0.0), {})[0]
    forced = (free + 1) % VOCAB  # not what the model picks unmasked
    first = prefill(target, [f"m-{spec.temperature}", "beside"], spec, {f"m-{spec.temperature}": only(forced)})
    assert first[0] == forced
    if spec.temperature == 0:
        assert first[1] == free  # the unmasked request beside it is untouched
    chain = [11, 22, 33]  # each node's row allows exactly the next chain token, then 44
    out = verify(target, f"m-{spec.temperature}", forced, chain, only(11, 22, 33, 44))
    assert out == [11, 22, 33, 44]
    for rid in ("free", "beside", f"m-{spec.temperature}"):
        target.release(rid)


def test_a_masked_prompt_with_prompt_logprobs_and_raw_logprobs(target):
    """The prompt's logits rows are all there (prompt logprobs): its one mask row limits the last, which
    chooses the first token; logprobs are the model's own, before the mask."""
    free = prefill(target, ["raw-free"], SamplingSpec(0.0), {})[0]
    forced = (free + 1) % VOCAB
    spec = SamplingSpec(0.0, logprobs=2, prompt_logprobs=True)
    entry = PrefillEntry("raw", next(_steps), 0, len(PROMPT), True, spec, masked=True)
    reply, out = target.forward(Forward([entry]), {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32),
                                                   "token_masks": only(forced)})
    assert reply.results[0].error is None and out["tokens"].tolist() == [forced]
    result = reply.results[0]  # the prompt's positions but the first, then the token's
    assert (result.num_prompt_logprobs, result.num_logprobs) == (len(PROMPT) - 1, 1)
    assert out["logprobs"][-1] < -1e-3  # its raw logprob: not the mask's certainty
    assert out["top_ids"][-2] == free  # (flat: 2 per row) the model's favourite ranks first, though masked
    for rid in ("raw-free", "raw"):
        target.release(rid)


def test_a_mask_tensor_that_disagrees_with_the_entries_refuses_the_call(target):
    entry = PrefillEntry("bad", next(_steps), 0, len(PROMPT), True, SamplingSpec(0.0), masked=True)
    tokens = {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)}
    for masks in (None, only(1, 2), only(1)[:, :-1], only(1).to(torch.int64)):
        tensors = dict(tokens) if masks is None else {**tokens, "token_masks": masks}
        with pytest.raises(BadCall, match="token_masks"):
            target.forward(Forward([entry]), tensors)
    assert not target.release("bad")  # refused before anything ran
