"""The logits changes that depend on the tokens so far (vLLM's semantics), node by node along a token tree.

`TokenHistory` is what the target keeps of a request for them, updated as tokens are committed (never
rescanned): which tokens its prompt and output hold, how often each occurred in the output, and how
many output tokens there are. `penalize` gives a tree's logits [n, V] as the request's parameters
change them at every node. Node i sees the committed output plus the draft tokens on its own path
from the root (node 0, already committed), never a sibling branch's: node i's row is exactly what the
target alone computes after the sequence root..i, so tree acceptance stays lossless and greedy output
is the same under every speculation policy.

In this order, on the logits before temperature, min_p, top-k and top-p (shared/spec/sampling.py),
greedy taking the argmax of the result:
- repetition_penalty r: every token in the prompt or the output so far: a positive logit is divided
  by r, any other multiplied by r;
- frequency_penalty f: minus f x the token's count in the output so far;
- presence_penalty p: minus p for every token the output so far holds;
- min_tokens: the stop ids (EOS and the request's stop_token_ids) are -inf at every node whose next
  token would be one of the first min_tokens output tokens.
Only the columns of tokens seen (prompt, output, the tree) are touched, so a step costs the tree's
rows times those columns, not the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.shared.spec.sampling import SamplingParams
from specserve.shared.spec.token_tree import ancestor_mask, depths


class TokenHistory:
    """A request's tokens as the penalties read them. `counts` and `seen` exist only when a penalty
    needs them (`SamplingParams.penalized`); min_tokens reads `num_output` alone."""

    def __init__(self, vocab_size: int, params: SamplingParams, num_prompt: int | None = None) -> None:
        """num_prompt: how many of the context tokens are the prompt (a preempted request's context goes on
        with its output); None: every context token is."""
        self.vocab_size = vocab_size
        self.num_prompt = num_prompt
        self.num_context = 0  # context tokens added (prompt, then a preempted request's earlier output)
        self.num_output = 0  # output tokens so far
        self.counts = torch.zeros(vocab_size, dtype=torch.float32) if params.penalized else None
        self.seen = torch.zeros(vocab_size, dtype=torch.bool) if params.penalized else None

    def add_context(self, tokens: Sequence[int]) -> None:
        """The next prefilled tokens: the prompt's, then (with `num_prompt`) output tokens."""
        prompt_left = len(tokens) if self.num_prompt is None else max(0, self.num_prompt - self.num_context)
        self.num_context += len(tokens)
        prompt, output = tokens[:prompt_left], tokens[prompt_left:]
        if self.seen is not None and len(prompt):
            self.seen[torch.as_tensor(list(prompt), dtype=torch.long)] = True
        self.add_output(output)

    def add_output(self, tokens: Sequence[int]) -> None:
        """Newly committed output tokens."""
        self.num_output += len(tokens)
        if self.counts is None or self.seen is None or not len(tokens):
            return
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        self.counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32))
        self.seen[ids] = True


def penalize(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], params: SamplingParams,
             history: TokenHistory) -> torch.Tensor:
    """logits [n, V] at a tree's nodes (tokens, parents: the tree, root first) -> the penalized logits,
    a new float32 tensor on the CPU."""
    out = logits.detach().to("cpu", torch.float32, copy=True)
    if params.penalized and history.counts is not None:
        _penalties(out, tokens, parents, params, history)
    if params.holds_stops and history.num_output < params.min_tokens:
        _hold_stops(out, parents, params, history.num_output)
    return out


def _penalties(out: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], params: SamplingParams,
               history: TokenHistory) -> None:
    """Repetition, frequency and presence penalties in place, on the columns of the tokens seen."""
    assert history.counts is not None and history.seen is not None
    drafted = torch.as_tensor(list(tokens[1:]), dtype=torch.long)  # the root is committed already
    ids = torch.unique(torch.cat([history.seen.nonzero().flatten(), drafted]))  # sorted
    if not len(ids):
        return
    # along[i, c]: how often token ids[c] stands on the path from the root (excluded) to node i (included)
    on_path = ancestor_mask(parents)[:, 1:].to(torch.float32)  # [n, n - 1]
    columns = torch.nn.functional.one_hot(torch.searchsorted(ids, drafted), len(ids)).to(torch.float32)
    along = on_path @ columns  # [n, len(ids)]
    counts = (history.counts[ids] + along).to(torch.float64)
    x = out[:, ids].to(torch.float64)  # any r > 0 is finite and nonzero here (float32 could round it to 0 or inf)
    if params.repetition_penalty != 1:
        seen = history.seen[ids] | (along > 0)
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty != 0:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty != 0:
        x = x - params.presence_penalty * (counts > 0).to(torch.float64)
    out[:, ids] = x.to(torch.float32)


def _hold_stops(out: torch.Tensor, parents: Sequence[int], params: SamplingParams, num_output: int) -> None:
    """min_tokens: the stop ids -inf at the nodes whose next token is among the first min_tokens."""
    ahead = torch.as_tensor(depths(parents), dtype=torch.long) + num_output  # output tokens before node i's next
    rows = torch.nonzero(ahead < params.min_tokens).flatten()
    stops = torch.as_tensor([t for t in params.stop_ids if 0 <= t < out.shape[-1]], dtype=torch.long)
    if len(rows) and len(stops):
        out[rows[:, None], stops[None, :]] = float("-inf")


__all__ = ["TokenHistory", "penalize"]
