"""What an HTTP front end asks of the engine: `EngineApi`; `LocalEngine`, the engine in the same
process. A front end in a process of its own uses `frontend.remote.RemoteEngine` instead, whose
questions the engine process answers through a `LocalEngine` (frontend/link.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Protocol

from specserve.gateway.engine.grammar import Grammars
from specserve.gateway.engine.loop import Engine
from specserve.gateway.engine.request import Event, GenRequest, Submission
from specserve.gateway.sched.slo_classes import SloClass


class EngineApi(Protocol):
    classes: dict[str, SloClass]  # the SLO classes requests are resolved against

    def submit(self, sub: Submission) -> asyncio.Queue[Event]:
        """Queue the request; its events (engine/request.py: Admitted, Tokens, Finished) arrive on the queue
        returned. ServiceUnavailable (503) when it is refused at once."""

    def abort(self, rid: str, reason: str = "abort") -> None:
        """End the request (client gone, or a stop string the handler found); its Finished, with its
        report, still arrives on its queue."""

    def count_error(self, code: str) -> None:
        """An error the front end answered itself (specserve:request_errors_total)."""

    def pool_tokens_short(self, prompt_tokens: int, max_tokens: int) -> int | None:
        """The largest KV pool in tokens when even it cannot hold the request (400); None when it can
        or when the engine checks it itself on submit."""

    async def health(self) -> tuple[int, dict]:
        """/health: (HTTP status, body)."""

    async def slo_classes(self) -> dict: ...

    async def metrics_text(self) -> str: ...


class LocalEngine:
    """The engine in this process."""

    def __init__(self, engine: Engine, classes: dict[str, SloClass], profile_path: Path,
                 grammars: Grammars | None = None):
        """grammars: structured output's compiler, for the grammars front ends of other processes name."""
        self.engine, self.classes, self.profile_path = engine, classes, profile_path
        self.grammars = grammars

    def submit(self, sub: Submission, events: asyncio.Queue | None = None) -> asyncio.Queue[Event]:
        """events: the queue the request's events go to (a new one if None)."""
        req = GenRequest.of(sub, events)
        self.engine.intake.submit(req)
        return req.events

    def abort(self, rid: str, reason: str = "abort") -> None:
        self.engine.intake.abort(rid, reason)

    def count_error(self, code: str) -> None:
        self.engine.metrics.on_error(code)

    def pool_tokens_short(self, prompt_tokens: int, max_tokens: int) -> int | None:
        return self.engine.intake.pool_tokens_short(prompt_tokens, max_tokens)

    async def health(self) -> tuple[int, dict]:
        e = self.engine
        draft = e.pool.draft
        now = time.monotonic()
        replicas = [{"index": t.index, "address": t.address, "up": t.ready, "state": t.state,
                     "running": len(t.requests), **t.readiness(now)} for t in e.pool.targets]
        target_ready = any(t.ready and not t.retired for t in e.pool.targets)
        body = {"status": "ok" if target_ready else "degraded", "target": target_ready,
                "draft": draft.ready if draft is not None else None,
                **({f"draft_{k}": v for k, v in draft.readiness(now).items()} if draft is not None else {}),
                "draft_offloaded": draft.offloaded if draft is not None else None,
                "replicas": replicas, "running": len(e.table.running), "waiting": len(e.table.waiting)}
        return 200 if target_ready else 503, body

    async def slo_classes(self) -> dict:
        targets = self.engine.pool.targets
        cost = targets[0].cost
        return {"classes": {n: {"tpot_ms": c.tpot_ms, "ttft_ms": c.ttft_ms} for n, c in self.classes.items()},
                "budget_tokens": cost.budget_tokens, "baseline_iteration_ms": cost.baseline_iteration_ms,
                "policy": self.engine.policy.describe(), "profile": str(self.profile_path),
                "cost_error": {str(t.index): t.cost.error_summary() for t in targets}}

    async def metrics_text(self) -> str:
        return self.engine.metrics.render()


__all__ = ["EngineApi", "LocalEngine"]


def kv_pool_error(engine: EngineApi, prompt_tokens: int, max_tokens: int) -> str | None:
    """Why the request cannot run even alone on the largest replica's KV pool (a 400), or None."""
    pool_tokens = engine.pool_tokens_short(prompt_tokens, max_tokens)
    if pool_tokens is None:
        return None
    return (f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} need more KV than the target's whole pool "
            f"({pool_tokens} tokens)")
