"""Hand-made iteration records with known totals, for what reads the engine's records (the gateway's
metrics, the bench's /metrics parsing)."""

from __future__ import annotations

from specserve.gateway.perf.record import DraftStep, IterationRecord, ReplicaStep, RequestStep


def sample_records() -> list[IterationRecord]:
    """Two iterations with known totals (47 tokens; draft 10 ms, target 35, transport 4, schedule 3;
    16 draft tokens, 6 accepted: 4, 2 and 0 at positions 0, 1, 2)."""
    return [
        # 40 tokens (25 prompt + 3 trees of 5); draft 10 ms inside its service, target 20 ms inside, a 24 ms
        # call (4 ms transport), 1 ms outside the calls; 12 draft tokens, 2 + 2 + 1 accepted (per position 3, 2)
        IterationRecord(
            1, [RequestStep("a", 0, verified=5, accepted=2, depth=4), RequestStep("b", 0, verified=5, accepted=2),
                RequestStep("c", 0, verified=5, accepted=1), RequestStep("p", 0, prompt_tokens=25)],
            [ReplicaStep(0, prefill_tokens=25, tree_nodes=15, call_ms=24.0, service_ms=20.0, forward_ms=17.0)],
            DraftStep(requests=3, call_ms=10.0, service_ms=10.0, catchup_ms=3.0, beam_ms=6.0, sync_service_ms=0.5),
            target_phase_ms=24.0, total_ms=35.0),
        # 7 tokens, no draft call, target 15 ms, 2 ms outside; one tree of 5 with 1 accepted
        IterationRecord(
            2, [RequestStep("a", 0, verified=5, accepted=1), RequestStep("q", 0, prompt_tokens=2)],
            [ReplicaStep(0, prefill_tokens=2, tree_nodes=5, call_ms=15.0, service_ms=15.0, forward_ms=12.5)],
            target_phase_ms=15.0, total_ms=17.0),
    ]
