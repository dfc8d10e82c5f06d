"""TargetEngine: one forward pass over prefill chunks and token trees, lossless acceptance, KV commit.

Per request it keeps the sampling parameters (and seeded generator), how much of the prompt is
prefilled, the committed token count and the newest committed token; with penalties or min_tokens
also its `TokenHistory` (token counts, updated as chunks and accepted tokens are committed). The KV cache holds every
committed token but the newest, which is the root of the request's next tree.

An entry sent a step ahead (`VerifyEntry.root_pending`) takes the request's newest committed token as its
root; a tree drafted on a guess of that step's answer (`VerifyEntry.guess`) becomes the subtree the answer picks,
or its root alone where the guess was wrong (`guarded`). A call first releases the requests it names
(`Forward.release`), then checks its entries one by one before the pass; a refused entry gets an error in its
result and changes nothing, and the others run. Capacity is checked up front, so the pass cannot run out of
KV blocks half way: tree steps (requests already decoding) are admitted before prefill chunks.

**Plain decodes** (a one-node tree of a greedy request with no token history, logprobs or mask: most entries of a
busy call) are checked in one loop before the others (`_plain_decodes`), run beside them in the pass with inputs
built by array operations (`ModelRunner.decode`), take their tokens from one argmax and are committed in one loop
(`_commit_plain`): the same checks, tokens and state as the per-entry path, without its layers; their KV blocks are
set aside before the other entries are fitted to the pool. A call of nothing else skips the rest too (`_decode`).

**Prefix cache** (`--no-prefix-caching` turns it off): a prefill chunk starts from the cached blocks of
its longest cached prefix (block_manager.py; a new request's first chunk, or a later chunk of one whose
KV fills whole cached blocks), less its last token, whose logits a last chunk needs; only the rest is
computed, and its result says how many tokens came from the cache (`StepResult.num_cached`). Committed
KV enters the cache block by block: the prompt as it is prefilled, the accepted output as trees are
committed (every token's KV but the newest, the next tree's root). A call that asks for the features
(an EAGLE draft reads every prompt token's) takes nothing from the cache, nor does a chunk that asks for
the logits of every row (prompt logprobs).

No request can fail another: an exception while checking or accepting one entry (sampling,
acceptance, the KV commit) ends that request alone. Its result carries `ErrorInfo("internal")`, it
is released on the spot (no state, no KV blocks), and the other entries' results stand. Only a
failure of the batched model pass itself fails the call, and that pass gives back every slot it took.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from specserve.shared.host.service_base import BadCall, flat_counts, ms_since, split_counts
from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.block_manager import OutOfBlocks
from specserve.shared.runtime.loader import load_model, parse_device, parse_dtype
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.spec import token_mask
from specserve.shared.spec.penalties import TokenHistory
from specserve.shared.spec.sampling import greedy_rows, greedy_tokens
from specserve.shared.spec.token_tree import InvalidTree, guessed_tree, validate_tree
from specserve.shared.spec.tree_acceptance import Acceptance, accept_tree
from specserve.shared.wire.messages import (
    VERIFY_MASKED,
    VERIFY_ROOT_PENDING,
    ErrorInfo,
    Forward,
    ForwardReply,
    PrefillEntry,
    ResultColumns,
    SamplingSpec,
    StatsReply,
    StepResult,
    VerifyEntry,
    column,
)
from specserve.shared.wire.transport import split_flat
from specserve.target.config import TargetConfig
from specserve.target.logprobs import CallLogprobs, LogprobState, check_spec, every_row
from specserve.target.state import TargetRequest, params_of

ROOT_ONLY = (-1,)  # the parents of a one-node tree
Plain = dict[int, tuple[TargetRequest, int]]  # by verify index: a plain decode's request and root
Accept = Callable[..., Acceptance]  # accept_tree(tokens, parents, logits, params, generator, history)


def guarded(entry: VerifyEntry, tokens: list[int], parents: list[int], committed: int,
            newest: int) -> tuple[VerifyEntry, list[int], list[int]]:
    """A root_pending tree drafted on a guess of the step before it (`VerifyEntry.guess`) as the request's state
    makes it (`guessed_tree`: the subtree the guess picks, or the root alone), its entry's count made the
    request's; as sent where that state is outside the guess's range (the check refuses it as out of sync)."""
    picked = guessed_tree(tokens, parents, entry.num_committed, entry.guess, committed, newest)
    if picked is None:
        return entry, tokens, parents
    tree_tokens, tree_parents = picked
    entry = msgspec.structs.replace(entry, num_committed=committed, num_nodes=len(tree_tokens))
    return entry, tree_tokens, tree_parents


class TargetEngine:
    def __init__(self, config: TargetConfig, runner: ModelRunner | None = None, accept: Accept | None = None):
        """runner, accept: the model pass and the acceptance rule (the model in config.model and
        shared.tree_acceptance.accept_tree, looked up per call, by default; `--simulate` gives its own,
        services/target/simulated.py)."""
        self.config = config
        self.device = parse_device(config.device)
        if runner is None:
            model = load_model(config.model, parse_dtype(config.dtype, self.device), self.device,
                               config.weights, config.kernels, config.activations)
            runner = ModelRunner(model, config.kv_blocks, config.block_size)
            if self.device.type == "cuda" and config.cuda_graphs and runner.inputs_for == "triton":
                runner.use_graphs()  # decode and verification replayed as CUDA graphs (one KV block for padding)
        self.runner = runner
        self.accept = accept
        self.vocab_size = runner.vocab_size
        self.requests: dict[str, TargetRequest] = {}
        self.calls = self.entry_errors = 0
        self.batched_decodes = True  # plain decodes run without the per-entry layers (off: as any entry, for tests)
        self.decode_calls = 0  # calls `_decode` ran
        self.plain_entries = 0  # plain decodes run without the per-entry layers (`_plain_decodes`), in any call

    def forward(self, msg: Forward, tensors: dict[str, torch.Tensor]) -> tuple[ForwardReply, dict]:
        start = time.perf_counter()
        self.calls += 1
        for rid in msg.release:  # before the entries: a preempted request may start again in this call
            self.release(rid)
        try:
            columns = [a.tolist() for a in msg.verify.arrays()]  # steps, committed, nodes, flags
            guesses = msg.verify.guess_list()
        except ValueError as exc:
            raise BadCall(f"verify entries: {exc}") from None
        counts = columns[2]
        trees = flat_counts(tensors, "tree_tokens", counts), flat_counts(tensors, "tree_parents", counts)
        plain = self._plain_decodes(msg, columns, guesses, *trees)
        if plain and len(plain) == len(msg.verify) and not msg.prefill:
            decoded = self._decode(msg, plain, columns[0], start)
            if decoded is not None:
                return decoded
        verify = msg.verify.entries(columns)  # the rest works entry by entry
        base = len(msg.prefill)
        plain_ids = [verify[j].rid for j in plain]  # (by verify index)
        reserved = self.runner.blocks.new_blocks_for_one(plain_ids) if plain else 0
        if reserved > self.runner.num_free_blocks:  # the general path refuses some
            plain, plain_ids, reserved = {}, [], 0
        errors: dict[int, ErrorInfo] = {}  # by result index: prefill entries first, then verify
        cached: dict[int, int] = {}  # by result index: the chunk's tokens taken from the prefix cache
        undo: list[Callable[[], None]] = []  # how to give them back (the pass failed)
        use_cache = self.config.prefix_caching and not msg.features  # features are computed, never cached
        masks = self._masks(msg.prefill, verify, tensors)
        entries = self._fit_to_pool(self._entries(msg.prefill, verify, tensors, trees, counts, errors, plain),
                                    len(msg.prefill), errors, cached if use_cache else None, undo, reserved)
        all_entries: list[PrefillEntry | VerifyEntry] = [*msg.prefill, *verify]
        captures = self._captures()
        self.runner.model_ms, self.runner.last_logits = 0.0, None
        logits, features, plain_logits = self._pass(msg, [e for _, e in entries], undo, plain_ids,
                                                    [root for _, root in plain.values()])
        forward_ms = self.runner.model_ms  # the model call alone: building its inputs is the service's own work
        t0 = time.perf_counter()
        emitted: dict[int, tuple[list[int], int]] = {}
        kept: dict[int, torch.Tensor] = {}  # by result index: the features returned
        scored = CallLogprobs()
        greedy = self._greedy(entries, len(msg.prefill), logits, masks)
        self.runner.last_logits = None  # (not kept past the call)
        for i, ((index, entry), entry_logits) in enumerate(zip(entries, logits)):
            try:
                chosen = entry_logits if index not in masks else token_mask.apply_last(entry_logits, masks[index])
                emitted[index], path = self._accept(all_entries[index], entry, chosen, greedy.get(i))
                if features:
                    kept[index] = features[i] if path is None else features[i][path]
                req = self.requests.get(entry.request_id)
                scored.add(index, None if req is None else req.logprobs, all_entries[index], entry.tokens,
                           entry_logits, emitted[index][0], path)
            except Exception as exc:  # this request alone ends; the others' results stand
                errors[index] = self._failed(entry.request_id, "acceptance", exc)
        if plain:
            assert plain_logits is not None
            tokens, indices = greedy_tokens(plain_logits), [base + j for j in plain]
            self._commit_plain([verify[j].rid for j in plain], [verify[j].step for j in plain],
                               [req for req, _ in plain.values()], tokens, indices, errors)
            for index, token in zip(indices, tokens):
                if index not in errors:
                    emitted[index] = ([token], 0)
        accept_ms = ms_since(t0)
        results, payload = self._results(all_entries, errors, emitted, kept, scored, cached)
        self.entry_errors += len(errors)
        return self._reply(results, forward_ms, accept_ms, start, captures), payload

    def _captures(self) -> int:
        """CUDA graphs captured so far (none without them, as in the simulated runner)."""
        graphs = getattr(self.runner, "graphs", None)
        return graphs.captures if graphs is not None else 0

    def _reply(self, results: ResultColumns, forward_ms: float, accept_ms: float, start: float,
               captures: int) -> ForwardReply:
        """The call's reply (a warmup call where the pass captured a CUDA graph: more captures than `captures`)."""
        return ForwardReply(results, forward_ms, accept_ms, ms_since(start), self.runner.num_free_blocks,
                            self._captures() > captures, cached_blocks=self.runner.blocks.num_cached_blocks)

    def _plain_decodes(self, msg: Forward, columns: list[list[int]], guesses: list[int], tokens: list[int],
                       parents_of: list[int]) -> Plain:
        """By verify index, the call's plain decodes (one-node trees, no mask) of plain requests
        (`TargetRequest.plain`) that pass the checks `_check_verify` makes, with their roots: they run without
        the per-entry layers (checks, acceptance), in one loop each. `columns`: the verify entries' steps, committed
        counts, nodes and flags (`VerifyColumns.arrays`) as lists, `guesses` their guesses (a root sent ahead
        after a chain: its count within num_committed ... + guess, `guarded`); `tokens`, `parents_of`: the call's
        tree tensors as flat lists. Empty when the call names a request twice (the general path says so), or with
        features asked, or with an acceptance rule of its own."""
        rids, prefill = msg.verify.rids, msg.prefill
        if msg.features or not rids or self.accept is not None or not self.batched_decodes \
                or len({*rids} | {e.rid for e in prefill}) != len(rids) + len(prefill):
            return {}
        requests, vocab = self.requests, self.vocab_size
        limit = self.config.kv_blocks * self.runner.blocks.block_size  # committed tokens whose step fits the pool
        steps, committed, nodes, flags = columns
        # node j of the call is entry j's root while every entry is one node (a busy call's usual case)
        starts = range(len(rids)) if len(tokens) == len(rids) and min(nodes) == 1 else \
            [at - n for at, n in zip(itertools.accumulate(nodes), nodes)]
        out: Plain = {}
        try:
            for j, (rid, node) in enumerate(zip(rids, starts)):
                if nodes[j] != 1 or flags[j] & VERIFY_MASKED or parents_of[node] != -1:
                    continue
                req = requests.get(rid)
                if req is None or not req.plain or steps[j] <= req.last_step or not 0 < req.committed <= limit:
                    continue
                pending = flags[j] & VERIFY_ROOT_PENDING
                if committed[j] != req.committed and not (pending and committed[j] < req.committed
                                                          <= committed[j] + guesses[j]):
                    continue
                token = req.last_token if pending else tokens[node]
                if token == req.last_token and 0 <= token < vocab:
                    out[j] = (req, token)
        except Exception:  # a state that cannot be read: the per-entry checks end that request alone
            return {}
        return out

    def _decode(self, msg: Forward, plain: Plain, steps: list[int], start: float) -> tuple[ForwardReply, dict] | None:
        """The call when every entry is a plain decode (`_plain_decodes`) and all fit the pool: run as one batch of
        decodes (`ModelRunner.decode`), argmaxed at once and committed, with the general path's results (`steps`:
        the entries' steps). None, having changed nothing, when they do not fit: the general path refuses some."""
        rids = msg.verify.rids
        reqs = [plain[j][0] for j in range(len(rids))]
        roots = [plain[j][1] for j in range(len(rids))]
        captures = self._captures()
        self.runner.model_ms, self.runner.last_logits = 0.0, None
        try:
            _, logits = self.runner.decode(rids, roots)
        except OutOfBlocks:
            return None
        forward_ms = self.runner.model_ms
        t0 = time.perf_counter()
        emitted = greedy_tokens(logits)
        self.runner.last_logits = None
        errors: dict[int, ErrorInfo] = {}
        self._commit_plain(rids, steps, reqs, emitted, range(len(rids)), errors)
        accept_ms = ms_since(t0)
        self.decode_calls += 1
        self.entry_errors += len(errors)
        counts = [0 if j in errors else 1 for j in range(len(rids))]
        results = ResultColumns(rids, msg.verify.steps, column(counts, np.int32), column([0] * len(rids), np.int32),
                                errors)
        tokens = emitted if not errors else [t for j, t in enumerate(emitted) if j not in errors]
        return self._reply(results, forward_ms, accept_ms, start, captures), {
            "tokens": torch.tensor(tokens, dtype=torch.int32)}

    def _commit_plain(self, rids: list[str], steps: list[int], reqs: list[TargetRequest], tokens: list[int],
                      indices: Sequence[int], errors: dict[int, ErrorInfo]) -> None:
        """Commit each plain decode's token (its KV was committed by the pass), keying a block of the prefix cache
        where one filled; a failure ends that request alone (its error in `errors` at its result index)."""
        bs, caching = self.runner.blocks.block_size, self.config.prefix_caching
        self.plain_entries += len(rids)
        for index, rid, step, req, token in zip(indices, rids, steps, reqs, tokens):
            try:
                committed = req.committed
                req.committed, req.last_token, req.last_step = committed + 1, token, step
                if caching and committed % bs == 0:  # its newest KV filled a block
                    self.runner.cache_prefix(rid, committed)
            except Exception as exc:
                errors[index] = self._failed(rid, "acceptance", exc)

    def _pass(self, msg: Forward, passed: list[Chunk | Tree], undo: list[Callable[[], None]], plain_ids: list[str],
              roots: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        """The model pass: each entry's logits (and features, when asked), and the plain decodes' logits (one row
        each, beside the entries: `ModelRunner.decode`); if it fails, the chunks give back what they took from the
        prefix cache (the runner gives back the slots it took)."""
        try:
            if plain_ids:
                others, plain_logits = self.runner.decode(plain_ids, roots, passed)
                return others, [], plain_logits
            if msg.features:  # (the entries were checked by `_entries`)
                return *self.runner.forward_features(passed, checked=True), None
            return (self.runner.forward(passed, checked=True) if passed else []), [], None
        except BaseException:
            for give_back in undo:
                give_back()
            raise

    def _entries(self, prefill_entries: list[PrefillEntry], verify_entries: list[VerifyEntry],
                 tensors: dict[str, torch.Tensor], trees: tuple[list[int], list[int]], counts: list[int],
                 errors: dict[int, ErrorInfo], plain: Plain) -> list[tuple[int, Chunk | Tree]]:
        """The call's entries that pass their checks, by result index (prefill first, then verify): a chunk
        (its logits at its last token where it ends the prompt) or a tree; the others' errors go to `errors`.
        `trees`: the tree tensors as flat lists (`flat_counts`) and `counts` the verify entries' nodes;
        `plain`: the plain decodes `_plain_decodes` checked already (not among them: they run beside them).
        A root-only step (a plain decode) runs as a one-token chunk: the pass treats both alike, and the
        accepted path of a one-node tree is its root, so its KV is committed at once."""
        chunks = split_counts(tensors, "prefill_tokens", [e.num_tokens for e in prefill_entries])
        tree_tokens, tree_parents = split_flat(trees[0], counts), split_flat(trees[1], counts)
        seen: set[str] = set()
        entries: list[tuple[int, Chunk | Tree]] = []
        for i, (prefill, toks) in enumerate(zip(prefill_entries, chunks)):
            error = self._isolated(prefill.rid, "check", self._check_prefill, prefill, toks, seen)
            if error:
                errors[i] = error
                continue
            req = self.requests.get(prefill.rid)
            state = req.logprobs if req is not None else LogprobState.of(prefill.sampling or SamplingSpec())
            at = range(len(toks)) if every_row(state) else [len(toks) - 1] if prefill.last else []
            entries.append((i, Chunk(prefill.rid, toks, logits_at=at)))
        base = len(prefill_entries)
        for j, (verify, toks, parents) in enumerate(zip(verify_entries, tree_tokens, tree_parents)):
            if j in plain:  # checked by `_plain_decodes`, run beside the entries
                seen.add(verify.rid)
                continue
            if verify.root_pending and toks and (req := self.requests.get(verify.rid)) is not None and req.decoding:
                toks[0] = req.last_token  # sent a step ahead: the root is what its last step emitted
                if (len(toks) > 1 or verify.guess) and not verify.masked:  # sent on a guess of that step's answer
                    verify, toks, parents = guarded(verify, toks, parents, req.committed, req.last_token)
            error = self._isolated(verify.rid, "check", self._check_verify, verify, toks, parents, seen)
            if error:
                errors[base + j] = error
            elif len(toks) == 1:
                entries.append((base + j, Chunk(verify.rid, toks, logits_at=(0,))))
            else:
                entries.append((base + j, Tree(verify.rid, toks, parents)))
        return entries

    def _masks(self, prefill: list[PrefillEntry], verify: list[VerifyEntry],
               tensors: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The masked entries' rows of "token_masks", by result index (a prefill chunk's one row applies to the
        first token, where the chunk ends the prompt); a tensor that disagrees with the entries refuses the call."""
        rows = [(1 if e.last else 0) if e.masked else 0 for e in prefill]
        rows += [e.num_nodes if e.masked else 0 for e in verify]
        flat = tensors.get("token_masks")
        if not sum(rows):
            return {}
        width = token_mask.words_for(self.vocab_size)
        if flat is None or flat.dtype != torch.int32 or list(flat.shape) != [sum(rows), width]:
            got = "none" if flat is None else f"{flat.dtype} {list(flat.shape)}"
            raise BadCall(f"tensor 'token_masks' must be int32 [{sum(rows)}, {width}], got {got}")
        out, at = {}, 0
        for index, n in enumerate(rows):
            if n:
                out[index], at = flat[at: at + n], at + n
        return out

    @staticmethod
    def _results(all_entries: list[PrefillEntry | VerifyEntry], errors: dict[int, ErrorInfo],
                 emitted: dict[int, tuple[list[int], int]], kept: dict[int, torch.Tensor],
                 scored: CallLogprobs, cached: dict[int, int]) -> tuple[ResultColumns, dict[str, torch.Tensor]]:
        """Each entry's result in order, and the payload: the emitted tokens, the features where kept,
        the logprobs where asked."""
        results, out, feats = [], [], []
        for index, message in enumerate(all_entries):
            if index in errors:
                results.append(StepResult(message.rid, message.step, 0, 0, errors[index]))
                continue
            tokens, accepted = emitted[index]
            out += tokens
            if index not in kept and index not in scored.rows and index not in cached:  # (most entries)
                results.append(StepResult(message.rid, message.step, len(tokens), accepted))
                continue
            rows = kept.get(index)
            if rows is not None:
                feats.append(rows)
            num_prompt, num_out, width = scored.fields(index)
            results.append(StepResult(message.rid, message.step, len(tokens), accepted,
                                      num_features=0 if rows is None else len(rows), num_prompt_logprobs=num_prompt,
                                      num_logprobs=num_out, top_logprobs=width,
                                      num_cached=cached.get(index, 0)))
        payload = {"tokens": torch.tensor(out, dtype=torch.int32)}
        if feats:
            payload["features"] = torch.cat(feats)
        payload.update(scored.payload([i for i in range(len(all_entries)) if i not in errors]))
        return ResultColumns.of(results), payload

    # ---- isolation ---------------------------------------------------------------------------
    def _isolated(self, rid: str, what: str, check: Callable[..., ErrorInfo | None], *args: Any) -> ErrorInfo | None:
        """Run one entry's check; an exception in it ends that request alone (see `_failed`)."""
        try:
            return check(*args)
        except Exception as exc:
            return self._failed(rid, what, exc)

    def _failed(self, rid: str, what: str, exc: Exception) -> ErrorInfo:
        """An unexpected failure of one request: release it here (its state, any pending tree and
        its KV blocks) and say why. The call's other entries are not touched."""
        self.release(rid)
        return ErrorInfo("internal", f"{rid!r}: {what} failed ({type(exc).__name__}: {str(exc)[:300]}); "
                         "the request was released")

    # ---- checks ------------------------------------------------------------------------------
    def _common(self, rid: str, step: int, tokens: list[int], seen: set[str]) -> ErrorInfo | None:
        if rid in seen:
            return ErrorInfo("duplicate_request", f"{rid!r} appears twice in one call")
        seen.add(rid)
        req = self.requests.get(rid)
        if req is not None and step <= req.last_step:
            return ErrorInfo("stale_step", f"step {step} of {rid!r} is not after {req.last_step}")
        if not tokens:
            return ErrorInfo("empty_entry", f"{rid!r}: an entry needs at least one token")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            return ErrorInfo("bad_token", f"{rid!r}: token ids outside 0..{self.vocab_size - 1}")
        return None

    def _check_prefill(self, entry: PrefillEntry, tokens: list[int], seen: set[str]) -> ErrorInfo | None:
        error = self._common(entry.rid, entry.step, tokens, seen)
        if error:
            return error
        req = self.requests.get(entry.rid)
        if req is None:
            if entry.start != 0:
                return ErrorInfo("unknown_request", f"{entry.rid!r} is unknown here; its first chunk must start at 0")
            spec = entry.sampling
            if spec is None:
                return ErrorInfo("bad_sampling", f"{entry.rid!r}: the first chunk must carry sampling parameters")
            try:
                params_of(spec)
            except ValueError as exc:
                return ErrorInfo("bad_sampling", f"{entry.rid!r}: {exc}")
            refused = check_spec(spec)
            if refused:
                return ErrorInfo("bad_sampling", f"{entry.rid!r}: {refused}")
        elif req.decoding or entry.start != req.prefilled:
            return ErrorInfo("out_of_sync", f"{entry.rid!r}: chunk starts at {entry.start}, but "
                             + ("the prompt is done" if req.decoding else f"{req.prefilled} tokens are prefilled"))
        total = self.runner.blocks.blocks_needed(entry.start + len(tokens))
        if total > self.config.kv_blocks:
            return self._too_large(entry.rid, entry.start + len(tokens))
        return None

    def _check_verify(self, entry: VerifyEntry, tokens: list[int], parents: list[int],
                      seen: set[str]) -> ErrorInfo | None:
        """None where the tree may be verified, else why not. `_plain_decodes` makes these checks (and `_common`'s)
        on one-node trees in one loop of its own: a check added here belongs there too."""
        error = self._common(entry.rid, entry.step, tokens, seen)
        if error:
            return error
        req = self.requests.get(entry.rid)
        if req is None:
            return ErrorInfo("unknown_request", f"{entry.rid!r} is unknown here (never prefilled, or released)")
        if not req.decoding or entry.num_committed != req.committed or tokens[0] != req.last_token:
            return ErrorInfo("out_of_sync", f"{entry.rid!r}: the step says {entry.num_committed} committed tokens "
                             f"ending in {tokens[0]}; the target has {req.committed} ending in {req.last_token}")
        try:
            validate_tree(tokens, parents)
        except InvalidTree as exc:
            return ErrorInfo("invalid_tree", f"{entry.rid!r}: {exc}")
        # The tree's nodes need slots while it is verified, though only the accepted path stays.
        if self.runner.blocks.blocks_needed(req.committed - 1 + len(tokens)) > self.config.kv_blocks:
            return self._too_large(entry.rid, req.committed - 1 + len(tokens))
        return None

    def _too_large(self, rid: str, tokens: int) -> ErrorInfo:
        """A request that can never fit the pool is released, so it holds no blocks."""
        self.release(rid)
        return ErrorInfo("too_large", f"{rid!r} needs {tokens} tokens of KV; the pool holds "
                         f"{self.config.kv_blocks * self.config.block_size}. The request was released.")

    def _fit_to_pool(self, entries: list[tuple[int, Chunk | Tree]], num_prefill: int, errors: dict[int, ErrorInfo],
                     cached: dict[int, int] | None, undos: list[Callable[[], None]],
                     reserved: int = 0) -> list[tuple[int, Chunk | Tree]]:
        """Admit tree steps (result indices from `num_prefill` on), then prefill chunks, while free blocks beyond
        `reserved` (the plain decodes') last; refuse the rest (retryable). With
        `cached` (the prefix cache in use), a chunk first takes what the cache holds of it (`_from_cache`; the
        tokens taken go to `cached`, how to give them back to `undos`), and gives it back if it is refused."""
        free = self.runner.num_free_blocks - reserved
        admitted = []
        for index, entry in sorted(entries, key=lambda x: x[0] < num_prefill):
            undo: Callable[[], None] | None = None
            try:
                if cached is not None and index < num_prefill and isinstance(entry, Chunk):
                    before = self.runner.num_free_blocks
                    entry, cached[index], undo = self._from_cache(entry)
                    free -= before - self.runner.num_free_blocks  # evictable blocks it holds now
                need = self.runner.blocks.extra_blocks_for(entry.request_id, len(entry.tokens))
            except Exception as exc:
                errors[index] = self._failed(entry.request_id, "the KV check", exc)
                continue
            if need > free:
                if undo is not None and cached is not None:
                    before = self.runner.num_free_blocks
                    undo()
                    free += self.runner.num_free_blocks - before
                    del cached[index]
                errors[index] = ErrorInfo("out_of_blocks", f"{entry.request_id!r} needs {need} KV blocks, "
                                          f"{free} are free now; retry after others finish")
                continue
            free -= need
            admitted.append((index, entry))
            if undo is not None:
                undos.append(undo)
        return sorted(admitted, key=lambda x: x[0])

    def _from_cache(self, chunk: Chunk) -> tuple[Chunk, int, Callable[[], None] | None]:
        """The chunk less what the prefix cache holds of its start (its last token always computed), the
        tokens taken, and how to give them back (None when none were taken)."""
        rid, runner = chunk.request_id, self.runner
        if any(i != len(chunk.tokens) - 1 for i in chunk.logits_at):  # prompt logprobs: every row is computed
            return chunk, 0, None
        had = runner.num_tokens(rid) if runner.has_request(rid) else None
        taken = runner.adopt_prefix(rid, chunk.tokens, len(chunk.tokens) - 1)
        if not taken:
            return chunk, 0, None
        rest = chunk.tokens[taken:]
        undo = (lambda: runner.release(rid)) if had is None else (lambda: runner.truncate(rid, had))
        return Chunk(rid, rest, logits_at=[len(rest) - 1] if chunk.logits_at else []), taken, undo

    # ---- acceptance --------------------------------------------------------------------------
    def _greedy(self, entries: list[tuple[int, Chunk | Tree]], num_prefill: int, logits: list[torch.Tensor],
                masks: dict[int, torch.Tensor]) -> dict[int, list[int]]:
        """By entry position, the argmax at every node of the trees (result indices from `num_prefill` on) whose
        acceptance reads their logits as they are (a greedy request with no token history for penalties or
        held-back stop ids, and no token mask), taken for all of them at once: on a GPU one read back a call
        instead of one a request."""
        if self.accept is not None:
            return {}
        plain = []
        for i, (index, entry) in enumerate(entries):
            req = self.requests.get(entry.request_id)
            if index >= num_prefill and index not in masks and req is not None and req.params.is_greedy \
                    and req.history is None:
                plain.append(i)
        return dict(zip(plain, greedy_rows([logits[i] for i in plain], self.runner.last_logits), strict=True))

    def _accept(self, message: PrefillEntry | VerifyEntry, entry: Chunk | Tree, logits: torch.Tensor,
                greedy: list[int] | None = None) -> tuple[tuple[list[int], int], list[int] | None]:
        """Commit the entry's outcome (greedy: its argmax at every node, from `_greedy`); return (emitted
        tokens, accepted draft nodes) and, for a tree, its accepted path (node indices, root first; None for
        a prefill chunk)."""
        rid = entry.request_id
        req = self.requests.get(rid)
        if isinstance(message, PrefillEntry):
            if req is None:
                spec = message.sampling
                assert spec is not None  # _check_prefill refused a first chunk without sampling parameters
                params = params_of(spec)
                history = (TokenHistory(self.vocab_size, params, spec.num_prompt)
                           if params.penalized or params.holds_stops else None)
                logprobs = LogprobState.of(spec)
                req = self.requests[rid] = TargetRequest(params, params.make_generator(), history=history,
                                                         logprobs=logprobs, plain=params.is_greedy and history is None
                                                         and logprobs is None)
            req.prefilled += message.num_tokens  # (the chunk's tokens taken from the prefix cache included)
            if req.history is not None:  # the whole chunk: its computed tokens and those taken from the cache
                req.history.add_context(self.runner.history[rid][message.start:message.start + message.num_tokens])
            req.last_step = message.step
            if self.config.prefix_caching:
                self.runner.cache_prefix(rid, req.prefilled)
            if not message.last:
                return ([], 0), None
            if message.resume_token is not None:  # a preempted request: its next token is already known
                token = message.resume_token
            else:
                token = (self.accept or accept_tree)([entry.tokens[-1]], [-1], logits[-1:], req.params,
                                                     req.generator, req.history).tokens[0]
            if req.history is not None:
                req.history.add_output([token])
            req.committed, req.last_token = req.prefilled + 1, token
            return ([token], 0), None
        assert req is not None  # _check_verify refused a tree of an unknown request
        parents = entry.parents if isinstance(entry, Tree) else ROOT_ONLY
        acceptance = accept_tree(entry.tokens, parents, logits, req.params, req.generator, req.history,
                                 greedy=greedy) if self.accept is None else \
            self.accept(entry.tokens, parents, logits, req.params, req.generator, req.history)
        if isinstance(entry, Tree):  # (a root-only step ran as a chunk: committed already)
            self.runner.commit_tree(rid, acceptance.path)
        if req.history is not None:
            req.history.add_output(acceptance.tokens)
        before, req.committed = req.committed, req.committed + len(acceptance.tokens)
        bs = self.runner.blocks.block_size
        if self.config.prefix_caching and (req.committed - 1) // bs > (before - 1) // bs:  # a block filled
            self.runner.cache_prefix(rid, req.committed - 1)  # the KV: every committed token but the newest
        req.last_token = acceptance.tokens[-1]
        req.last_step = message.step
        return (acceptance.tokens, acceptance.num_accepted_drafts), list(acceptance.path)

    # ---- release, stats ----------------------------------------------------------------------
    def release(self, rid: str) -> bool:
        known = self.requests.pop(rid, None) is not None
        if self.runner.has_request(rid):
            self.runner.release(rid)
            known = True
        return known

    def free_blocks(self) -> int:
        return self.runner.num_free_blocks

    def stats(self) -> StatsReply:
        free = self.runner.num_free_blocks
        total = self.config.kv_blocks - (1 if getattr(self.runner, "graphs", None) is not None else 0)  # padding's
        return StatsReply("target", total, free, total - free,
                          self.config.block_size, len(self.requests), self.calls, self.entry_errors,
                          request_ids=sorted(self.requests), prefix_caching=self.config.prefix_caching,
                          cached_blocks=self.runner.blocks.num_cached_blocks,
                          evictable_blocks=self.runner.blocks.num_evictable_blocks,
                          device="simulated" if self.runner.inputs_for == "simulated" else self.device.type)
