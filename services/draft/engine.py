"""DraftEngine: per-request token history, KV catch-up, beam speculation, offload and reload.

The draft keeps every committed token a request has sent it. Its KV cache holds a prefix of them
(`synced`); a call appends the rest in chunks, then runs the beam search from the newest token.
Because the history lives here, dropping the KV pool (offload) loses nothing: after a reload each
request's KV is rebuilt from its history on its next call.

Every method runs on the service's single model thread, one call at a time, and either completes
or leaves the request as it was (refused entries record nothing).

No request can fail another: an exception in the per-request work of a Speculate (its checks, its
share of the KV fit, its catch-up bookkeeping, its beam setup, its reply) ends that request alone.
It gets `ErrorInfo("internal")` and is released here (history and KV); the gateway then rebuilds
its draft state from its committed tokens, as after any refused entry. A failure of a batched model
pass (catch-up or a beam step) still fails the call, and the call's requests are restored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.draft.beam import BeamRequest, BeamTree, beam_search
from specserve.draft.config import DraftConfig
from specserve.draft.entry_check import check_entry
from specserve.draft.prefix import cache_committed, cache_stats, take_cached
from specserve.draft.static_step import StaticBeamStep
from specserve.shared.host.service_base import ms_since, split_counts
from specserve.shared.runtime.batch import Chunk
from specserve.shared.runtime.kv_cache import KVCache
from specserve.shared.runtime.lean_model import LeanModel
from specserve.shared.runtime.loader import load_model, parse_device, parse_dtype
from specserve.shared.runtime.model import CausalLM
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.wire.messages import (
    DraftTree,
    ErrorInfo,
    Offload,
    Reload,
    Speculate,
    SpeculateEntry,
    SpeculateReply,
    StatsReply,
    TransitionReply,
)

Tree = tuple[list[int], list[int], list[float]]  # a drafted tree: tokens, parents, path log-probabilities


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # every committed token received, prompt first
    synced: int = 0  # leading tokens whose KV is in the draft cache
    last_step: int = -1


class DraftEngine:
    reads_features = False  # the calls carry the target's features (the EAGLE draft)
    model: CausalLM | LeanModel | None  # the token model (the n-gram, EAGLE and simulated drafts have none)

    def __init__(self, config: DraftConfig):
        self._init_state(config)
        self.model = load_model(config.model, parse_dtype(config.dtype, self.device), self.device,
                                config.weights, config.kernels, config.activations)
        self._new_pool()
        self.vocab_size = self.model.config.vocab_size

    def _init_state(self, config: DraftConfig) -> None:
        """The fields every draft engine has before its model (the subclasses without a token model
        call this instead of __init__): no requests, no pool, nothing offloaded, no calls."""
        self.config = config
        self.device = parse_device(config.device)
        self.model = None
        self.runner: ModelRunner | None = None  # None while offloaded
        self.static_step: StaticBeamStep | None = None
        self.requests: dict[str, _Request] = {}
        self._host_weights: dict[str, torch.Tensor] | None = None
        self.calls = self.entry_errors = 0
        self.last_offload_s = self.last_reload_s = 0.0

    def _new_pool(self) -> None:
        """A fresh KV pool (and, on CUDA, fresh graphs: captured graphs point at the old pool)."""
        self.runner = ModelRunner(self._token_model(), self.config.kv_blocks, self.config.block_size)
        use_graphs = self.device.type == "cuda" and self.config.cuda_graphs
        self.static_step = StaticBeamStep(self.runner, use_graphs=True) if use_graphs else None

    def _token_model(self) -> CausalLM | LeanModel:
        """The token model (the drafts without one override _new_pool, offload and reload, its callers)."""
        assert self.model is not None, f"{type(self).__name__} has no token model"
        return self.model

    def _pool(self) -> ModelRunner:
        """The KV pool's runner (its callers run only while the pool is loaded, not offloaded)."""
        assert self.runner is not None, "the draft is offloaded"
        return self.runner

    # ---- speculate ---------------------------------------------------------------------------
    def speculate(self, msg: Speculate, tensors: dict[str, torch.Tensor]) -> tuple[SpeculateReply, dict]:
        t0 = time.perf_counter()
        captures = self.static_step.captures if self.static_step is not None else 0
        self.calls += 1
        new_tokens = split_counts(tensors, "tokens", [e.num_new for e in msg.entries])
        errors = self._validate(msg.entries, new_tokens)
        accepted = [(e, toks) for e, toks, err in zip(msg.entries, new_tokens, errors) if err is None]
        before = {e.rid: self._snapshot(e.rid) for e, _ in accepted}
        for entry, toks in accepted:
            req = self.requests.setdefault(entry.rid, _Request([]))
            req.tokens.extend(toks)
            req.last_step = entry.step
        self._take_payload(msg.entries, {e.rid for e, _ in accepted}, tensors)
        depths = {e.rid: e.depth for e, _ in accepted}
        failed: dict[str, ErrorInfo] = {}  # requests whose own work failed: released before the reply
        catchup_ms = beam_ms = 0.0
        forwards = 0
        trees: dict[str, Tree] = {}
        if self.runner is not None and accepted:
            trees, catchup_ms, beam_ms, forwards = self._draft([e for e, _ in accepted], depths, failed, before)
        results, payload = self._results(msg.entries, errors, trees, depths, failed)
        self.entry_errors += len(failed)
        self._forget_assumed([e for e, _ in accepted if e.num_assumed > 0 and e.rid not in failed])
        warmup = self.static_step is not None and self.static_step.captures > captures
        reply = SpeculateReply(results, catchup_ms, beam_ms, ms_since(t0), forwards, self.free_blocks(),
                               offloaded=self.runner is None, warmup=warmup)
        return reply, payload

    def _draft(self, accepted: list[SpeculateEntry], depths: dict[str, int], failed: dict[str, ErrorInfo],
               before: dict[str, tuple[int, int] | None]) -> tuple[dict[str, Tree], float, float, int]:
        """Catch the accepted requests up and run their beams: each one's tree (tokens, parents, path
        log-probability), the two phases' ms and the forward passes. A request whose own work fails goes
        to `failed`; a failure of the call as a whole restores every request and raises."""
        try:
            skip = self._fit_to_pool(accepted, depths, failed)
            t1 = time.perf_counter()
            root_logits, forwards = self._catch_up([e for e in accepted if e.rid not in failed], depths, skip, failed)
            catchup_ms = ms_since(t1)
            t1 = time.perf_counter()
            beams = []
            for e in accepted:
                if e.rid in failed or depths[e.rid] <= 0:
                    continue
                try:
                    beams.append(BeamRequest(e.rid, self.requests[e.rid].tokens[-1], root_logits[e.rid],
                                             depths[e.rid], e.width))
                except Exception as exc:
                    failed[e.rid] = _failure(e.rid, "the beam setup", exc)
            found, beam_forwards = self._beam_search(beams)
        except BaseException:
            self._restore(before)  # the call failed as a whole: no request may keep half of it
            for rid in failed:  # these may be half way through their own work: drop them
                self.release(rid)
            raise
        trees = {rid: (t.tokens, t.parents, t.logp) for rid, t in found.items()}
        return trees, catchup_ms, ms_since(t1), forwards + beam_forwards

    def _results(self, entries: list[SpeculateEntry], errors: list[ErrorInfo | None],
                 trees: dict[str, Tree], depths: dict[str, int],
                 failed: dict[str, ErrorInfo]) -> tuple[list[DraftTree], dict[str, torch.Tensor]]:
        """Each entry's result in order (its tree, a root alone where it drafted none, or its error; a
        failed request is released) and the payload of the trees' tokens, parents and path probabilities."""
        out_tokens: list[int] = []
        out_parents: list[int] = []
        out_logp: list[float] = []
        results = []
        for entry, error in zip(entries, errors):
            if error is None and entry.rid not in failed:
                try:
                    tokens, parents, logp = trees.get(entry.rid, ([self.requests[entry.rid].tokens[-1]], [-1], [0.0]))
                    depth = depths[entry.rid] if entry.rid in trees else 0
                    tree = DraftTree(entry.rid, entry.step, len(tokens), depth)
                except Exception as exc:
                    failed[entry.rid] = _failure(entry.rid, "the reply", exc)
                else:
                    out_tokens += tokens
                    out_parents += parents
                    out_logp += logp
                    results.append(tree)
                    continue
            if error is None:
                error = failed[entry.rid]
                self.release(entry.rid)
            results.append(DraftTree(entry.rid, entry.step, 0, 0, error))
        return results, {
            "tokens": torch.tensor(out_tokens, dtype=torch.int32),
            "parents": torch.tensor(out_parents, dtype=torch.int32),
            "path_prob": torch.tensor(out_logp, dtype=torch.float32).exp(),
        }

    def _take_payload(self, entries: list[SpeculateEntry], accepted: set[str],
                      tensors: dict[str, torch.Tensor]) -> None:
        """The call's other payload, for the accepted entries (a feature-level draft takes the target's
        features here; a token draft has none)."""

    def _beam_search(self, beams: list[BeamRequest]) -> tuple[dict[str, BeamTree], int]:
        """The beam speculation of one call (the simulated draft replaces it: services/draft/simulated.py)."""
        return beam_search(self._pool(), beams, self.static_step)

    def _validate(self, entries: list[SpeculateEntry], new_tokens: list[list[int]]) -> list[ErrorInfo | None]:
        errors: list[ErrorInfo | None] = []
        seen: set[str] = set()
        for entry, toks in zip(entries, new_tokens):
            try:
                req = self.requests.get(entry.rid)
                error = check_entry(entry, toks, entry.rid in seen, None if req is None else len(req.tokens),
                                    -1 if req is None else req.last_step, self.config, self.vocab_size)
            except Exception as exc:  # a first occurrence of the id (duplicates are refused first)
                error = _failure(entry.rid, "the check", exc)
                self.release(entry.rid)
            seen.add(entry.rid)
            errors.append(error)
        self.entry_errors += sum(e is not None for e in errors)
        return errors

    def _forget_assumed(self, entries: list[SpeculateEntry]) -> None:
        """Drafting ahead: drop the guessed tokens the trees grew from (history and KV); the gateway
        sends them again once they are committed."""
        for entry in entries:
            req = self.requests[entry.rid]
            del req.tokens[len(req.tokens) - entry.num_assumed:]
            if req.synced > len(req.tokens):
                req.synced = len(req.tokens)
                if self.runner is not None and self.runner.has_request(entry.rid):
                    self.runner.truncate(entry.rid, req.synced)

    def _snapshot(self, rid: str) -> tuple[int, int] | None:
        req = self.requests.get(rid)
        return None if req is None else (len(req.tokens), req.last_step)

    def _restore(self, before: dict[str, tuple[int, int] | None]) -> None:
        for rid, snap in before.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if snap is None:
                self.release(rid)
                continue
            del req.tokens[snap[0] :]
            req.last_step = snap[1]
            if req.synced > len(req.tokens):
                req.synced = len(req.tokens)
                self._pool().truncate(rid, req.synced)

    def _fit_to_pool(self, entries: list[SpeculateEntry], depths: dict[str, int],
                     failed: dict[str, ErrorInfo]) -> set[str]:
        """Shrink speculation, then catch-up, of the entries the free KV blocks cannot hold.

        Speculation is optional: a request that does not fit gets a root-only tree (depth 0); one
        whose catch-up does not fit either stays behind (its tokens are kept; it catches up later).
        A request whose check raises goes into `failed` and takes no blocks.
        """
        blocks = self._pool().blocks
        take_cached(self.config.prefix_caching, self._pool(), self.requests, entries, failed, _failure)  # prefix.py
        free = blocks.num_free_blocks
        skip = set()
        for entry in entries:
            try:
                req = self.requests[entry.rid]
                lag = len(req.tokens) - req.synced
                beam_nodes = max(depths[entry.rid] - 1, 0) * entry.width
                need = blocks.extra_blocks_for(entry.rid, lag + beam_nodes)
                if need > free:
                    depths[entry.rid] = 0
                    need = blocks.extra_blocks_for(entry.rid, lag)
                    if need > free:
                        need = 0
                        skip.add(entry.rid)
            except Exception as exc:
                failed[entry.rid] = _failure(entry.rid, "the KV fit", exc)
                continue
            free -= need
        return skip

    def _catch_up(self, entries: list[SpeculateEntry], depths: dict[str, int], skip: set[str],
                  failed: dict[str, ErrorInfo]) -> tuple[dict[str, torch.Tensor], int]:
        """Append each request's unsynced tokens in chunks; return the root logits of those with d > 0.

        A request whose own preparation raises goes into `failed` and is left out of the passes."""
        runner, cfg = self._pool(), self.config
        todo = {}
        for entry in entries:
            if entry.rid in skip:
                depths[entry.rid] = 0
                continue
            try:
                req = self.requests[entry.rid]
                if req.synced == len(req.tokens) and depths[entry.rid] > 0:
                    # Nothing new since the last call: re-run the newest token to get its logits again.
                    req.synced -= 1
                    runner.truncate(entry.rid, req.synced)
            except Exception as exc:
                failed[entry.rid] = _failure(entry.rid, "the catch-up", exc)
                continue
            if req.synced < len(req.tokens):
                todo[entry.rid] = req
        root_logits: dict[str, torch.Tensor] = {}
        forwards = 0
        while todo:
            batch, budget = [], cfg.max_batch_tokens
            for rid, req in todo.items():
                take = min(len(req.tokens) - req.synced, cfg.prefill_chunk, budget)
                if take <= 0:
                    break
                done = req.synced + take == len(req.tokens)
                batch.append(Chunk(rid, req.tokens[req.synced : req.synced + take],
                                   logits_at=[take - 1] if done and depths[rid] > 0 else ()))
                budget -= take
            for chunk, logits in zip(batch, runner.forward(batch)):
                req = todo[chunk.request_id]
                req.synced += len(chunk.tokens)
                if len(logits):
                    root_logits[chunk.request_id] = logits[0]
            forwards += 1
            todo = {rid: req for rid, req in todo.items() if req.synced < len(req.tokens)}
        cache_committed(self.config.prefix_caching, runner, self.requests, [e for e in entries if e.rid not in failed])
        return root_logits, forwards

    # ---- release, stats ----------------------------------------------------------------------
    def release(self, rid: str) -> bool:
        if self.requests.pop(rid, None) is None:
            return False
        if self.runner is not None and self.runner.has_request(rid):
            self.runner.release(rid)
        return True

    def free_blocks(self) -> int:
        return self.runner.num_free_blocks if self.runner is not None else 0

    def stats(self) -> StatsReply:
        reserved = 1 if self.static_step is not None else 0  # the static step's scratch block
        total = self.config.kv_blocks - reserved if self.runner is not None else 0
        free = self.free_blocks()
        return StatsReply("draft", total, free, total - free, self.config.block_size, len(self.requests),
                          self.calls, self.entry_errors, offloaded=self.runner is None,
                          last_offload_s=self.last_offload_s, last_reload_s=self.last_reload_s,
                          request_ids=sorted(self.requests), **cache_stats(self.runner, self.config.prefix_caching))

    # ---- offload, reload ---------------------------------------------------------------------
    def offload(self, _msg: Offload | None = None,
                _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        """Weights to host memory, KV pool freed. Speculation is off until reload."""
        if self.runner is None:
            return self._transition(0.0, 0, 0), None
        t0 = time.perf_counter()
        kv_bytes = self.runner.kv.data.nbytes
        pin = self.device.type == "cuda"
        host = {}
        for name, param in _weights(self._token_model()):
            host[name] = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin).copy_(param.detach())
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)  # frees the device copy
        self._host_weights = host
        self.runner = self.static_step = None
        for req in self.requests.values():
            req.synced = 0
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.last_offload_s = time.perf_counter() - t0
        return self._transition(self.last_offload_s, _nbytes(host), kv_bytes), None

    def reload(self, _msg: Reload | None = None,
               _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        """Weights back on the device and a fresh, empty KV pool; requests catch up on their next call."""
        if self.runner is not None:
            return self._transition(0.0, 0, 0), None
        t0 = time.perf_counter()
        host, model = self._host_weights, self._token_model()
        assert host is not None  # offload kept the weights here
        for name, param in _weights(model):
            param.data = host[name].to(self.device, non_blocking=True)
        self._host_weights = None
        self._new_pool()
        _sync(self.device)
        self.last_reload_s = time.perf_counter() - t0
        kv_bytes = KVCache.bytes_per_block(model.config, self.config.block_size, self._pool().dtype)
        return self._transition(self.last_reload_s, _nbytes(host), kv_bytes * self.config.kv_blocks), None

    def _transition(self, seconds: float, weight_bytes: int, kv_bytes: int) -> TransitionReply:
        return TransitionReply(self.runner is None, round(seconds, 6), weight_bytes, kv_bytes, len(self.requests))


def _failure(rid: str, what: str, exc: Exception) -> ErrorInfo:
    """The error of a request whose own work raised; the caller releases the request."""
    return ErrorInfo("internal", f"{rid!r}: {what} failed ({type(exc).__name__}: {str(exc)[:300]}); "
                     "the request was released")


def _weights(model: CausalLM | LeanModel) -> list[tuple[str, torch.Tensor]]:
    """The tensors offload moves: the torch pass's parameters, or the compiled pass's weight buffers."""
    return list(model.named_buffers() if isinstance(model, LeanModel) else model.named_parameters())


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
