"""EagleDrafter: an EagleHead's per-request KV, its catch-up over (feature, token) entries, and beam speculation.

A request's entries are appended as the target's features arrive: entry i pairs feature i with token
i + 1, so a request with n committed tokens and n - 1 features has n - 1 entries, and the newest
entry's predicted feature gives the logits of the token after the newest committed one (the root of
its tree). Speculation is AdaServe's Spec() over the head: step 1 expands the root into its top-w
children, each later step runs the w newest nodes of every request in one batched pass (each node
attends to the request's entries and to its own ancestors) and keeps the top-w of the w x V'
extensions by cumulative log probability. The KV holds only entries between calls: nodes are never
kept. Every tensor op but attention is batched across requests; attention runs per request over its
own dense KV (one layer: a few hundred keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.draft.beam import BeamTree, _select
from specserve.draft.eagle_head import EagleHead


@dataclass(slots=True)
class _Entries:
    k: torch.Tensor  # [n, kv_heads, d]
    v: torch.Tensor
    last: torch.Tensor | None = None  # the newest entry's predicted feature [H]

    @property
    def n(self) -> int:
        return self.k.shape[0]


@dataclass(slots=True)
class _Pending:
    """A request's tree nodes while its beam search runs."""

    k: list[torch.Tensor] = field(default_factory=list)  # per run node [kv_heads, d]
    v: list[torch.Tensor] = field(default_factory=list)
    path: dict[int, list[int]] = field(default_factory=dict)  # tree node -> indices into k/v of its path
    predicted: dict[int, torch.Tensor] = field(default_factory=dict)  # tree node -> its predicted feature


class EagleDrafter:
    def __init__(self, head: EagleHead):
        self.head = head
        self.dtype = head.attn_norm.weight.dtype
        self.device = head.attn_norm.weight.device
        self.requests: dict[str, _Entries] = {}

    def entries(self, rid: str) -> int:
        e = self.requests.get(rid)
        return 0 if e is None else e.n

    def release(self, rid: str) -> bool:
        return self.requests.pop(rid, None) is not None

    def truncate(self, rid: str, n: int) -> None:
        """Keep the first n entries (the newest entry's prediction is gone until it is re-run)."""
        e = self.requests[rid]
        if n < e.n:
            e.k, e.v, e.last = e.k[:n], e.v[:n], None

    @torch.inference_mode()
    def append(self, items: list[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
        """Append entries: (rid, features [m, H], tokens [m] the tokens after them) per request, in one
        batched pass. Returns the number of entries run."""
        items = [(rid, f, t) for rid, f, t in items if len(t)]
        if not items:
            return 0
        h = self.head
        for rid, _, _ in items:
            self.requests.setdefault(rid, _Entries(self._empty(), self._empty()))
        feats = torch.cat([f for _, f, _ in items]).to(self.device, self.dtype)
        toks = torch.cat([t for _, _, t in items]).to(self.device, torch.int64)
        positions = torch.cat([torch.arange(self.requests[rid].n, self.requests[rid].n + len(t))
                               for rid, _, t in items]).to(self.device)
        x = h.inputs(feats, toks)
        q, k, v = h.qkv(x, positions)
        outs, at = [], 0
        for rid, _, t in items:
            m, e = len(t), self.requests[rid]
            keys, values = torch.cat((e.k, k[at:at + m])), torch.cat((e.v, v[at:at + m]))
            mask = torch.ones(m, keys.shape[0], dtype=torch.bool, device=self.device).tril(e.n)
            outs.append(h.attend(q[at:at + m], keys, values, mask))
            e.k, e.v = keys, values
            at += m
        predicted = h.finish(x, torch.cat(outs))
        at = 0
        for rid, _, t in items:
            at += len(t)
            self.requests[rid].last = predicted[at - 1]
        return len(items)

    def _empty(self) -> torch.Tensor:
        h = self.head
        return torch.empty(0, h.kv_heads, h.head_dim, dtype=self.dtype, device=self.device)

    def _last(self, rid: str) -> torch.Tensor:
        """The newest entry's predicted feature (its tree's root; speculate's requests have run it)."""
        last = self.requests[rid].last
        assert last is not None, f"{rid!r}: the newest entry has not run"
        return last

    @torch.inference_mode()
    def speculate(self, requests: list[tuple[str, int, int, int]]) -> tuple[dict[str, BeamTree], int]:
        """(rid, root token, depth >= 1, width >= 1) per request whose newest entry has run -> the trees
        (tokens are target ids, root first) and the number of batched passes run."""
        h = self.head
        vocab = h.vocab
        trees = {rid: BeamTree([root], [-1], [0.0], [0]) for rid, root, _, _ in requests}
        if not requests:
            return trees, 0
        pending = {rid: _Pending(path={0: []}, predicted={0: self._last(rid)}) for rid, *_ in requests}
        root_logp = torch.log_softmax(h.logits(torch.stack([self._last(rid) for rid, *_ in requests])), -1)
        for (rid, _, _, width), lp in zip(requests, root_logp):
            _select(trees[rid], torch.zeros(1), lp[None], width)
        passes = 0
        for step in range(2, max(d for _, _, d, _ in requests) + 1):
            active = [(rid, w) for rid, _, d, w in requests if d >= step]
            nodes = [(rid, i) for rid, _ in active for i in trees[rid].layer]
            parents = [trees[rid].parents[i] for rid, i in nodes]
            feats = torch.stack([pending[rid].predicted[p] for (rid, _), p in zip(nodes, parents)])
            toks = vocab[torch.tensor([trees[rid].tokens[i] for rid, i in nodes], device=self.device)]
            positions = torch.tensor([self.requests[rid].n + step - 2 for rid, _ in nodes], device=self.device)
            x = h.inputs(feats, toks)
            q, k, v = h.qkv(x, positions)
            outs = []
            for j, ((rid, i), p) in enumerate(zip(nodes, parents)):
                e, pend = self.requests[rid], pending[rid]
                path = pend.path[p] + [len(pend.k)]
                pend.k.append(k[j])
                pend.v.append(v[j])
                pend.path[i] = path
                keys = torch.cat((e.k, torch.stack([pend.k[a] for a in path])))
                values = torch.cat((e.v, torch.stack([pend.v[a] for a in path])))
                outs.append(h.attend(q[j:j + 1], keys, values, None))
            predicted = h.finish(x, torch.cat(outs))
            logp = torch.log_softmax(h.logits(predicted), -1)
            passes += 1
            at = 0
            for rid, width in active:
                tree, pend = trees[rid], pending[rid]
                n = len(tree.layer)
                for j, i in enumerate(tree.layer):
                    pend.predicted[i] = predicted[at + j]
                _select(tree, torch.tensor([tree.logp[i] for i in tree.layer]), logp[at:at + n], width)
                at += n
        ids = vocab.tolist()
        for tree in trees.values():
            tree.tokens[1:] = [ids[t] for t in tree.tokens[1:]]
        return trees, passes
