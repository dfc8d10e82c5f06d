"""Target-only generation on the runner: the reference that speculative decoding must reproduce."""

from __future__ import annotations

from collections.abc import Mapping

from specserve.shared.runtime.batch import Chunk
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.spec.sampling import SamplingParams, probabilities, sample

GREEDY = SamplingParams(temperature=0.0)


def generate(
    runner: ModelRunner,
    prompts: Mapping[str, list[int]],
    max_new_tokens: int,
    params: SamplingParams = GREEDY,
    prefill_chunk: int | None = None,
    stop_ids: set[int] | frozenset[int] = frozenset(),
) -> dict[str, list[int]]:
    """Continuous-batched incremental decoding of every prompt; frees their KV at the end.

    Prefill runs in chunks of `prefill_chunk` tokens (all of the prompt when None).
    """
    generators = {rid: params.make_generator() for rid in prompts}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    pending = {rid: list(toks) for rid, toks in prompts.items()}  # tokens not yet fed
    try:
        while pending:
            entries = []
            for rid, toks in pending.items():
                take = len(toks) if prefill_chunk is None else min(prefill_chunk, len(toks))
                last = take == len(toks)
                entries.append(Chunk(rid, toks[:take], logits_at=[take - 1] if last else []))
                pending[rid] = toks[take:]
            for entry, logits in zip(entries, runner.forward(entries)):
                rid = entry.request_id
                if logits.shape[0] == 0:
                    continue
                if params.is_greedy:
                    token = int(logits[0].argmax())
                else:
                    token = sample(probabilities(logits, params)[0], generators[rid])
                outputs[rid].append(token)
                if len(outputs[rid]) < max_new_tokens and token not in stop_ids:
                    pending[rid] = [token]
            pending = {rid: toks for rid, toks in pending.items() if toks}
    finally:
        for rid in prompts:
            if runner.has_request(rid):
                runner.release(rid)
    return outputs
