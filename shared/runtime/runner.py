"""ModelRunner: one model, its paged KV cache, and the per-request sequence state.

forward(entries) runs one pass over a ragged batch of chunks and trees. Chunks are committed at
once. A tree's KV stays pending until commit_tree(request_id, path) keeps the accepted
root-to-node path (copying those KV rows into sequence order, no recompute) and frees the rest.
DraftNodes (the draft's beam search) grow one pending forest over several passes, one beam layer
per pass, until discard_tree drops it.

It keeps each request's committed tokens (`history`: the token of every committed slot), so that
`cache_prefix` can key its full blocks of committed tokens in the block manager's prefix cache, and
`adopt_prefix` can start a request (or continue one) from the cached blocks of its next tokens.
Pending trees and draft nodes are never cached: only committed slots have a token in `history`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.shared.runtime.batch import Chunk, DraftNodes, Entry, ModelInputs, Tree, build_inputs, validate_entry
from specserve.shared.runtime.block_manager import BlockManager, OutOfBlocks, UnknownRequest
from specserve.shared.runtime.cuda_graphs import MAX_TOKENS, GraphedPasses
from specserve.shared.runtime.kv_cache import KVCache
from specserve.shared.runtime.lean_inputs import Decodes, LeanInputs, build_lean_inputs
from specserve.shared.runtime.lean_model import LeanModel
from specserve.shared.runtime.loader import load_model
from specserve.shared.runtime.model import CausalLM

__all__ = ["ModelRunner", "OutOfBlocks", "UnknownRequest", "PendingTree"]


RunModel = Callable[[CausalLM, KVCache, ModelInputs], torch.Tensor]


class PendingTree(RuntimeError):
    """A request still has an uncommitted tree; commit or discard it before its next forward."""


@dataclass(slots=True)
class _Pending:
    start: int  # committed tokens before the tree = logical slot of the root
    parents: list[int]
    forest: bool = False  # grown by DraftNodes passes (can only be discarded)


class ModelRunner:
    def __init__(self, model: CausalLM | LeanModel, num_blocks: int, block_size: int = 16):
        """model: the torch pass (CausalLM) or the compiled CPU operators' (LeanModel)."""
        self.model = model
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        # How a pass's inputs are built: "lean" (the compiled CPU pass), "triton" or "sdpa" (the torch pass's
        # attention, CausalLM.attention); fixed here for the model this runner was given.
        self.inputs_for: str
        if isinstance(model, LeanModel):
            self.device, self.dtype, self.inputs_for = model.device, model.dtype, "lean"
        else:
            param = next(model.parameters())
            self.device, self.dtype, self.inputs_for = param.device, param.dtype, model.attention
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv = KVCache(self.config, num_blocks, block_size, self.dtype, self.device,
                          head_major=self.inputs_for == "lean")
        self.windows = set(self.config.sliding_windows) or {None}
        self._pending: dict[str, _Pending] = {}
        self.history: dict[str, list[int]] = {}  # per request, the token of each committed slot
        self._pending_tokens: dict[str, list[int]] = {}  # per request, its pending tree's tokens
        self.graphs: GraphedPasses | None = None  # Triton passes at bucketed shapes (`use_graphs`)
        self.model_ms = 0.0  # the last pass's model call alone (its inputs built, its logits not yet split)
        self.last_logits: torch.Tensor | None = None  # that call's logits, before `forward` splits them by entry

    def use_graphs(self, capture: bool = True, max_tokens: int = MAX_TOKENS) -> None:
        """Run the torch pass with Triton attention at bucketed static shapes from now on, captured as CUDA
        graphs on CUDA with `capture` (shared/runtime/cuda_graphs.py). Takes one KV block for the padding rows."""
        if self.inputs_for != "triton":
            raise ValueError("CUDA graphs of the target's passes need the torch pass with Triton attention")
        assert isinstance(self.model, CausalLM)
        self.graphs = GraphedPasses(self.model, self.kv, self.blocks, self.device, capture, max_tokens)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        num_blocks: int,
        block_size: int = 16,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        weights: str = "auto",
        kernels: str = "auto",
        activations: str = "auto",
    ) -> ModelRunner:
        """`weights`, `kernels` and `activations` as `loader.load_model` takes them."""
        model = load_model(model_dir, dtype, device, weights=weights, kernels=kernels, activations=activations)
        return cls(model, num_blocks, block_size)

    # ---- state ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def num_tokens(self, request_id: str) -> int:
        """Tokens of the request whose KV is committed."""
        pending = self._pending.get(request_id)
        return pending.start if pending else self.blocks.num_slots(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.blocks

    def has_pending(self, request_id: str) -> bool:
        """The request has an uncommitted tree or draft nodes."""
        return request_id in self._pending

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Forget committed KV past the first `num_tokens` tokens (no pending tree allowed)."""
        if request_id in self._pending:
            raise PendingTree(f"request {request_id!r} has an uncommitted tree")
        self.blocks.truncate(request_id, num_tokens)
        if request_id in self.history:
            del self.history[request_id][num_tokens:]

    def release(self, request_id: str) -> None:
        """Free every KV block of the request (raises UnknownRequest if it has none); its cached blocks
        stay in the prefix cache."""
        self._pending.pop(request_id, None)
        self._pending_tokens.pop(request_id, None)
        self.history.pop(request_id, None)
        self.blocks.free(request_id)

    # ---- the prefix cache ------------------------------------------------------------------
    def cache_prefix(self, request_id: str, num_tokens: int) -> int:
        """Key the request's full blocks among its first `num_tokens` committed tokens in the prefix cache
        (blocks keyed before are skipped); returns the blocks that entered it. Callers keep the newest
        committed token out (its slot is written again when the next pass re-runs or replaces it)."""
        committed = min(num_tokens, self.num_tokens(request_id))
        return self.blocks.cache(request_id, self.history.get(request_id, ()), committed)

    def adopt_prefix(self, request_id: str, tokens: Sequence[int], limit: int) -> int:
        """Start the request's next `tokens` from the prefix cache: the cached blocks of their longest cached
        prefix (at most `limit` tokens) become its own, as if computed. The request is new, or holds whole
        keyed blocks and no pending tree (else nothing is taken). Returns the tokens taken."""
        if request_id in self._pending:
            return 0
        taken = self.blocks.adopt(request_id, tokens, limit)
        if taken:
            self.history.setdefault(request_id, []).extend(tokens[:taken])
        return taken

    # ---- forward -------------------------------------------------------------------------
    def forward(self, entries: Sequence[Entry], run_model: RunModel | None = None,
                checked: bool = False) -> list[torch.Tensor]:
        """Run one pass; return per entry the float32 logits [len(logits_at), vocab] it asked for.

        run_model(model, kv, inputs) replaces the plain model call (the draft's static-shape CUDA
        graph replay); it must return the logits rows of inputs.logits_indices.
        checked: the caller has checked the entries already (one entry a request; tokens in the vocabulary,
        trees well formed, logits rows inside their entries), so they are not checked again here.
        Raises OutOfBlocks (nothing changed) if the batch does not fit in the free KV blocks.
        """
        if not entries:
            return []
        prior_parents = self._check(entries, checked)
        starts, is_new = self._take_slots(entries)
        try:
            outputs = self._compute(entries, starts, prior_parents, run_model)
        except BaseException:
            self._give_back(entries, starts, is_new)
            raise
        self._note(entries, starts, prior_parents)
        return outputs

    def decode(self, request_ids: Sequence[str], tokens: Sequence[int],
               others: Sequence[Entry] = ()) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`forward(others, checked=True)` and in the same pass one-token chunks asking for their logits
        (`Chunk(rid, [token], logits_at=(0,))`: a batch of plain decodes, known requests named once, none among
        `others`), their inputs built by array operations: (the logits of `others` as `forward` gives them, the
        decodes' logits [len(request_ids), vocab]). Raises OutOfBlocks (nothing changed) if they do not fit."""
        if self.inputs_for not in ("lean", "triton") or not self._pending.keys().isdisjoint(request_ids):
            # (the torch pass, or a request with a pending tree: `forward` raises PendingTree)
            chunks = [Chunk(rid, [t], logits_at=(0,)) for rid, t in zip(request_ids, tokens)]
            outputs = self.forward([*others, *chunks], checked=True)
            return outputs[:len(others)], torch.cat(outputs[len(others):])
        prior_parents = self._check(others, checked=True)
        starts, is_new = self._take_slots(others)
        try:
            decode_starts = self.blocks.append_one(request_ids)
        except BaseException:
            self._give_back(others, starts, is_new)
            raise
        try:
            lean = build_lean_inputs(others, starts, self.blocks, prior_parents,
                                     Decodes(request_ids, decode_starts, tokens))
            logits = self._run_lean(lean)
        except BaseException:
            for rid, start in zip(request_ids, decode_starts):
                self.blocks.truncate(rid, start)
            self._give_back(others, starts, is_new)
            raise
        self._note(others, starts, prior_parents)
        history = self.history
        for rid, token in zip(request_ids, tokens):
            history[rid].append(token)
        rows = len(logits) - len(request_ids)
        return list(torch.split(logits[:rows], lean.logits_splits[:len(others)])), logits[rows:]

    def _check(self, entries: Sequence[Entry], checked: bool) -> dict[int, list[int]]:
        """Refuse entries of requests with a pending tree (DraftNodes grow their own forest) and, unless `checked`,
        malformed ones and a request twice; returns the DraftNodes entries' pending parents, by entry index."""
        seen: set[str] = set()
        prior_parents: dict[int, list[int]] = {}
        for i, entry in enumerate(entries):
            pending = self._pending.get(entry.request_id)
            if isinstance(entry, DraftNodes):
                if entry.request_id not in self.blocks:
                    raise UnknownRequest(entry.request_id)
                if pending is not None and not pending.forest:
                    raise PendingTree(f"request {entry.request_id!r} has an uncommitted tree")
                if pending is not None:
                    prior_parents[i] = pending.parents
            elif pending is not None:
                raise PendingTree(f"request {entry.request_id!r} has an uncommitted tree")
            if checked:
                continue
            validate_entry(entry, self.vocab_size, len(prior_parents.get(i, ())))
            if entry.request_id in seen:
                raise ValueError(f"request {entry.request_id!r} appears twice in one batch")
            seen.add(entry.request_id)
        return prior_parents

    def _take_slots(self, entries: Sequence[Entry]) -> tuple[list[int], list[bool]]:
        """Allocate the entries' slots (OutOfBlocks, nothing changed, if they do not fit): each one's slot count
        before, and whether its request is new."""
        is_new = [e.request_id not in self.blocks for e in entries]
        starts = [0 if new else self.blocks.num_slots(e.request_id) for e, new in zip(entries, is_new)]
        if entries:
            self.blocks.append_slots({e.request_id: len(e.tokens) for e in entries})
        return starts, is_new

    def _give_back(self, entries: Sequence[Entry], starts: list[int], is_new: list[bool]) -> None:
        """Undo `_take_slots` (the pass failed): new requests disappear, others shrink back."""
        for entry, start, new in zip(entries, starts, is_new):
            if new:
                self.blocks.free(entry.request_id)
            else:
                self.blocks.truncate(entry.request_id, start)

    def _note(self, entries: Sequence[Entry], starts: list[int], prior_parents: dict[int, list[int]]) -> None:
        """After the pass: a chunk's tokens join its history (committed); a tree or draft nodes stay pending."""
        for i, (entry, start) in enumerate(zip(entries, starts)):
            if isinstance(entry, Chunk):
                self.history.setdefault(entry.request_id, []).extend(entry.tokens)
            elif isinstance(entry, Tree):
                self._pending[entry.request_id] = _Pending(start, list(entry.parents))
                self._pending_tokens[entry.request_id] = list(entry.tokens)
            elif isinstance(entry, DraftNodes):
                if i in prior_parents:  # only DraftNodes entries have prior parents
                    self._pending[entry.request_id].parents.extend(entry.parents)
                else:
                    self._pending[entry.request_id] = _Pending(start, list(entry.parents), forest=True)

    def forward_features(self, entries: Sequence[Entry],
                         checked: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`forward`, and per entry the final norm's output at each of its tokens [len(tokens), hidden]
        float32 (a feature-level draft's input). The logits are those `forward` gives; the pass runs
        without CUDA graphs."""
        model = self.model
        model.keep_features, model.features = True, None
        try:
            logits = self.forward(entries, checked=checked)
            features = model.features
        finally:
            model.keep_features, model.features = False, None
        if not entries:
            return logits, []
        assert features is not None
        return logits, list(torch.split(features.float(), [len(e.tokens) for e in entries]))

    def _compute(self, entries: Sequence[Entry], starts: list[int], prior_parents: dict[int, list[int]],
                 run_model: RunModel | None) -> list[torch.Tensor]:
        """The model pass of `forward`, once the entries' slots are taken: per entry its logits rows.
        (The simulated runner, shared/simulate/runner.py, replaces this and `_move_kv` alone.)"""
        if self.inputs_for == "lean" and run_model is not None:
            raise ValueError("run_model replaces the torch pass; the compiled CPU pass has none")
        if self.inputs_for == "lean" or (self.inputs_for == "triton" and run_model is None):
            # (the static step's graphs take SDPA's inputs)
            lean = build_lean_inputs(entries, starts, self.blocks, prior_parents)
            return list(torch.split(self._run_lean(lean), lean.logits_splits))
        assert isinstance(self.model, CausalLM)
        inputs = build_inputs(entries, starts, self.blocks, self.windows, self.device, prior_parents)
        t0 = time.perf_counter()
        logits = (run_model or _run_model)(self.model, self.kv, inputs)
        self.model_ms, self.last_logits = self._timed(t0), logits
        return list(torch.split(logits, inputs.logits_splits))

    def _run_lean(self, lean: LeanInputs) -> torch.Tensor:
        """The model call on a pass's per-token key layout (the compiled CPU pass, or the torch pass with
        Triton attention, replayed as a CUDA graph where one fits): the logits rows of lean.logits_indices."""
        t0 = time.perf_counter()
        logits: torch.Tensor
        if isinstance(self.model, LeanModel):
            logits = self.model(lean, self.kv)
        elif self.graphs is not None and self.graphs.fits(lean) and not self.model.keep_features:
            logits = self.graphs.run(lean)
        else:
            logits = self.model(lean.input_ids.to(self.device), lean.positions.to(self.device), self.kv,
                                lean.keys.to(self.device), lean.logits_indices.to(self.device))
        self.model_ms, self.last_logits = self._timed(t0), logits
        return logits

    def _timed(self, t0: float) -> float:
        """Milliseconds since t0 once the device has run what was queued (on CUDA a synchronization, which the
        caller's read of the logits would make anyway)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) * 1e3

    def commit_tree(self, request_id: str, path: Sequence[int]) -> None:
        """Keep the KV of the accepted path (node indices root first); drop the rest of the tree."""
        pending = self._pending.get(request_id)
        if pending is None:
            raise PendingTree(f"request {request_id!r} has no pending tree to commit")
        if pending.forest:
            raise PendingTree(f"request {request_id!r} holds draft nodes, which can only be discarded")
        if not path or path[0] != 0:
            raise ValueError("an accepted path starts at the root (node 0)")
        for parent, child in zip(path, path[1:]):
            if not 0 < child < len(pending.parents) or pending.parents[child] != parent:
                raise ValueError(f"path {list(path)} is not a root-to-node path of the tree")
        if len(path) < len(pending.parents):  # (a path through every node is a chain, its KV in place already)
            start = pending.start
            tree_slots = self.blocks.physical_slots(request_id, start, len(pending.parents))
            src = [tree_slots[node] for node in path]
            dst = tree_slots[: len(path)]
            moves = [(s, d) for s, d in zip(src, dst) if s != d]
            if moves:
                s, d = zip(*moves)
                self._move_kv(list(s), list(d))
            self.blocks.truncate(request_id, start + len(path))
        del self._pending[request_id]
        tokens = self._pending_tokens.pop(request_id, [])
        self.history.setdefault(request_id, []).extend(tokens[n] for n in path)

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy KV rows from physical slots `src` to `dst` (commit_tree's compaction)."""
        self.kv.move_slots(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))

    def discard_tree(self, request_id: str) -> None:
        """Drop a pending tree entirely, root included (the sequence is as before the forward)."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            raise PendingTree(f"request {request_id!r} has no pending tree to discard")
        self._pending_tokens.pop(request_id, None)
        self.blocks.truncate(request_id, pending.start)


def _run_model(model: CausalLM, kv: KVCache, inputs: ModelInputs) -> torch.Tensor:
    logits: torch.Tensor = model(inputs.input_ids, inputs.positions, kv, inputs.attention, inputs.logits_indices)
    return logits
