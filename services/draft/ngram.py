"""The n-gram draft (`specserve draft --model ngram`, `specserve up --draft-model ngram`): trees drafted
from the request's own tokens (prompt and output so far), with no model (prompt lookup, as vLLM's and
SGLang's n-gram speculators and HF's `prompt_lookup_num_tokens` do, grown into trees).

For a request's history t[0..L): the longest suffix of at most `max_n` tokens that also occurs earlier
is matched (the most recent `MAX_MATCHES` occurrences), and what followed each occurrence, up to
`depth` tokens, is merged into a trie. The tree keeps, layer by layer, the `width` nodes followed by
the most occurrences; a node's path probability is the share of occurrences that continue with its
path. No match: a root-only tree. So it drafts chains (width 1) and trees (several continuations of
the matched suffix), and every policy can use it, AdaServe's trees included.

`NgramDraftEngine` is the DraftEngine (history, checks, assumed tokens, releases) with no weights and
no KV cache (`NoKV`): the gateway cannot tell it from a model draft. It serves any target, whatever
its tokenizer: token ids are only compared, never looked up. Offload and reload have nothing to move.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specserve.draft.beam import BeamRequest, BeamTree
from specserve.draft.config import DraftConfig
from specserve.draft.engine import DraftEngine
from specserve.shared.wire.messages import ErrorInfo, Offload, Reload, SpeculateEntry, TransitionReply

NGRAM = "ngram"  # the --model / --draft-model value that selects this draft
MAX_N = 4  # longest suffix matched
MAX_MATCHES = 32  # most recent occurrences merged into the tree
ANY_TOKEN = 2**31 - 1  # no vocabulary: any token id the int32 payload carries is accepted


def ngram_tree(tokens: list[int] | np.ndarray, depth: int, width: int, max_n: int = MAX_N) -> BeamTree:
    """The draft tree after `tokens` (root: its last token), at most `depth` deep and `width` nodes a layer."""
    seq = np.asarray(tokens, dtype=np.int64)
    root = BeamTree([int(seq[-1])], [-1], [0.0])
    if depth <= 0 or len(seq) < 2:
        return root
    starts = _continuations(seq, max_n)
    if not len(starts):
        return root
    conts = [seq[s:s + depth] for s in starts]
    total = len(conts)
    # the trie, layer by layer: a kept node's children are the tokens that follow its path
    tokens_out, parents, logp = root.tokens, root.parents, root.logp
    layer: list[tuple[int, list[np.ndarray]]] = [(0, conts)]  # (node index, the continuations through it)
    for k in range(depth):
        children: list[tuple[int, int, int, list[np.ndarray]]] = []  # (count, parent node, token, continuations)
        for node, through in layer:
            by_token: dict[int, list[np.ndarray]] = {}
            for c in through:
                if len(c) > k:
                    by_token.setdefault(int(c[k]), []).append(c)
            children += [(len(cs), node, tok, cs) for tok, cs in by_token.items()]
        if not children:
            break
        children.sort(key=lambda x: -x[0])  # stable: the earlier parent's child wins a tie
        layer = []
        for count, node, tok, cs in children[:width]:
            tokens_out.append(tok)
            parents.append(node)
            logp.append(math.log(count / total))
            layer.append((len(tokens_out) - 1, cs))
    return BeamTree(tokens_out, parents, logp)


def _continuations(seq: np.ndarray, max_n: int) -> np.ndarray:
    """Where the text after the most recent occurrences of the longest matching suffix starts, newest first
    (so that among continuations followed equally often, the newest is kept)."""
    n_tokens = len(seq)
    for n in range(min(max_n, n_tokens - 1), 0, -1):
        suffix = seq[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # occurrences that have a next token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            return hits[-MAX_MATCHES:][::-1] + n
    return np.empty(0, dtype=np.int64)


class NoKV:
    """The runner of a draft without a model: no KV cache, every block free (the engine's KV fit,
    truncation and release find nothing to do)."""

    def __init__(self, blocks: int):
        self.num_free_blocks = blocks

    def has_request(self, _rid: str) -> bool:
        return False

    def truncate(self, _rid: str, _num_tokens: int) -> None:
        return None


class NgramDraftEngine(DraftEngine):
    def __init__(self, config: DraftConfig):
        self._init_state(config)  # DraftEngine.__init__ would load a model
        self.vocab_size = ANY_TOKEN
        self.runner = NoKV(config.kv_blocks)  # type: ignore[assignment]

    def _fit_to_pool(self, entries: list[SpeculateEntry], depths: dict[str, int],
                     failed: dict[str, ErrorInfo]) -> set[str]:
        return set()  # no KV: everything fits

    def _catch_up(self, entries: list[SpeculateEntry], depths: dict[str, int], skip: set[str],
                  failed: dict[str, ErrorInfo]) -> tuple[dict[str, torch.Tensor], int]:
        """Nothing to append to a cache; the roots need no logits (an empty tensor stands for them)."""
        return {e.rid: torch.empty(0) for e in entries if depths[e.rid] > 0}, 0

    def _beam_search(self, beams: list[BeamRequest]) -> tuple[dict[str, BeamTree], int]:
        return {r.rid: ngram_tree(self.requests[r.rid].tokens, r.depth, r.width) for r in beams}, 0

    def offload(self, _msg: Offload | None = None,
                _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        """Nothing to move: the drafting stays on (the gateway's offload policy gains nothing here)."""
        return self._transition(0.0, 0, 0), None

    def reload(self, _msg: Reload | None = None,
               _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        return self._transition(0.0, 0, 0), None
