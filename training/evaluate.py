"""Measure the demo pair: held-out loss, top-1 agreement, speculative acceptance, forward cost.

Acceptance is measured greedily through our own runtime. The target's greedy continuation of
each prompt is computed once; speculation is then simulated against it. The draft builds a
candidate tree by beam search (AdaServe's Spec(): depth d, width w, d*w nodes plus the root), every
node is verified, and the step accepts the longest root path that matches the target's continuation
plus one bonus token. A chain of k tokens is the beam tree with w = 1, d = k.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaForCausalLM

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.generate import generate
from specserve.shared.runtime.runner import ModelRunner
from training.data import fixed_windows

CHAINS = tuple(range(1, 9))
TREES = ((2, 2), (3, 2), (4, 2), (3, 3), (4, 4), (6, 4))  # (depth, width)
NEW_TOKENS = 64  # tokens of target continuation per prompt over which acceptance is measured
NUM_PROMPTS = 64
EVAL_WINDOWS = 96  # held-out windows of 512 tokens for loss and agreement


@torch.inference_mode()
def heldout_metrics(target_dir: Path, draft_dir: Path, stream: np.ndarray) -> dict:
    """Mean next-token cross-entropy of both models and how often their argmax agrees."""
    models = {k: LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
              for k, d in (("target", target_dir), ("draft", draft_dir))}
    windows = fixed_windows(stream, 512, EVAL_WINDOWS)
    nll = {"target": 0.0, "draft": 0.0}
    agree = total = 0
    for i in tqdm(range(0, len(windows), 8), desc="held-out loss", unit="batch"):
        w = windows[i:i + 8]
        x, y = w[:, :-1], w[:, 1:]
        argmax = {}
        for k, m in models.items():
            logits = m(input_ids=x).logits.float()
            nll[k] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            argmax[k] = logits.argmax(-1)
        agree += (argmax["target"] == argmax["draft"]).sum().item()
        total += y.numel()
    return {"tokens": total, "target_loss": round(nll["target"] / total, 4),
            "draft_loss": round(nll["draft"] / total, 4), "top1_agreement": round(agree / total, 4)}


def _beam_tree(draft: ModelRunner, rids: list[str], roots: dict[str, int], d: int, w: int) -> dict:
    """Batched beam search from each request's root: per request (tokens, parents), root first."""
    tokens = {r: [roots[r]] for r in rids}
    parents = {r: [-1] for r in rids}
    logf = {r: torch.zeros(1) for r in rids}  # log path probability of the current beam layer
    layer = {r: [0] for r in rids}  # node indices of the current beam layer
    for _ in range(d):
        entries = [Tree(r, tokens[r], parents[r], logits_at=layer[r]) for r in rids]
        for r, logits in zip(rids, draft.forward(entries)):
            draft.discard_tree(r)
            scores = (logf[r][:, None] + F.log_softmax(logits, dim=-1)).flatten()
            top = torch.topk(scores, w)
            vocab = logits.shape[-1]
            new_layer = []
            for score_idx in top.indices.tolist():
                new_layer.append(len(tokens[r]))
                parents[r].append(layer[r][score_idx // vocab])
                tokens[r].append(score_idx % vocab)
            logf[r], layer[r] = top.values, new_layer
    return {r: (tokens[r], parents[r]) for r in rids}


def _matched_depth(tokens: list[int], parents: list[int], expected: list[int]) -> int:
    """Depth of the deepest root path whose tokens equal `expected` (greedy verification)."""
    node, depth = 0, 0
    while depth < len(expected):
        nxt = [i for i, p in enumerate(parents) if p == node and tokens[i] == expected[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


@torch.inference_mode()
def simulate(draft: ModelRunner, prompts: dict[str, list[int]], conts: dict[str, list[int]], d: int, w: int,
             new_tokens: int | dict[str, int]) -> float:
    """Mean tokens per verification step (accepted draft tokens + 1 bonus) over all prompts, over the first
    `new_tokens` tokens of each continuation (one count for all, or one per prompt)."""
    limit = new_tokens if isinstance(new_tokens, dict) else dict.fromkeys(prompts, new_tokens)
    done = {r: 0 for r in prompts}  # continuation tokens committed so far
    steps = produced = 0
    # The draft holds KV for everything but the newest token, which is the next tree's root.
    draft.forward([Chunk(r, p[:-1]) for r, p in prompts.items() if len(p) > 1])
    roots = {r: p[-1] for r, p in prompts.items()}
    active = list(prompts)
    try:
        while active:
            trees = _beam_tree(draft, active, roots, d, w)
            feed = []
            for r in active:
                p = done[r]
                m = _matched_depth(*trees[r], conts[r][p:p + d])
                accepted = conts[r][p:p + m + 1]
                steps += 1
                produced += len(accepted)
                done[r] = p + len(accepted)
                feed.append(Chunk(r, [roots[r]] + accepted[:-1]))
                roots[r] = accepted[-1]
            draft.forward(feed)
            active = [r for r in active if done[r] < limit[r]]
    finally:
        for r in prompts:
            if draft.has_request(r):
                draft.release(r)
    return produced / steps


def forward_cost(target: ModelRunner, draft: ModelRunner, context: int = 128, rounds: int = 40) -> dict:
    """Median time of a 1-token decode at `context` tokens of KV, target and draft alternating."""
    times: dict[str, list[float]] = {"target": [], "draft": []}
    runners = {"target": target, "draft": draft}
    with torch.inference_mode():
        for r in runners.values():
            r.forward([Chunk("cost", list(range(1, context + 1)))])
        for _ in range(rounds):
            for name, r in runners.items():
                t0 = time.perf_counter()
                r.forward([Tree("cost", [5], [-1])])
                times[name].append(time.perf_counter() - t0)
                r.discard_tree("cost")
        for r in runners.values():
            r.release("cost")
    t, dr = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"context": context, "target_ms": round(t * 1e3, 3), "draft_ms": round(dr * 1e3, 3),
            "ratio": round(t / dr, 2), "threads": torch.get_num_threads()}


def distinct_line_ratio(text: str) -> float:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return len(set(lines)) / len(lines) if lines else 1.0


def _prompts(tok, workloads: Path, category: str, count: int) -> tuple[list[dict], dict[str, list[int]]]:
    records = [json.loads(line) for line in open(workloads / f"{category}.jsonl")][:count]
    return records, {r["id"]: tok.encode(r["prompt"], add_special_tokens=False).ids for r in records}


def run(target_dir: Path, draft_dir: Path, build: Path, workloads: Path) -> dict:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    out: dict = {"heldout": heldout_metrics(target_dir, draft_dir, np.load(build / "heldout.npy"))}
    target = ModelRunner.from_dir(target_dir, num_blocks=8192)
    draft = ModelRunner.from_dir(draft_dir, num_blocks=8192)
    out["forward_cost"] = forward_cost(target, draft)
    records, prompts = _prompts(tok, workloads, "short", NUM_PROMPTS)
    t0 = time.perf_counter()
    conts = generate(target, prompts, NEW_TOKENS + max(CHAINS) + 1)
    out["target_greedy"] = {
        "prompts": len(prompts), "new_tokens": NEW_TOKENS, "generate_s": round(time.perf_counter() - t0, 1),
        "distinct_line_ratio_mean": round(statistics.mean(
            distinct_line_ratio(tok.decode(c[:NEW_TOKENS])) for c in conts.values()), 3),
        "samples": [{"prompt_tail": r["prompt"][-200:], "continuation": tok.decode(conts[r["id"]][:NEW_TOKENS])}
                    for r in records[:3]],
    }
    chains = {}
    for k in tqdm(CHAINS, desc="chains", unit="k"):
        chains[str(k)] = round(simulate(draft, prompts, conts, k, 1, NEW_TOKENS), 3)
    trees = {}
    for d, w in tqdm(TREES, desc="beam trees", unit="tree"):
        trees[f"d{d}w{w}"] = {"depth": d, "width": w, "nodes": d * w,
                              "tokens_per_step": round(simulate(draft, prompts, conts, d, w, NEW_TOKENS), 3)}
    # The other categories, for the later benchmarks: chain k = 4 and one beam tree.
    other = {}
    for category in tqdm(("medium", "long"), desc="other categories"):
        _, cat_prompts = _prompts(tok, workloads, category, NUM_PROMPTS // 2)
        cat_conts = generate(target, cat_prompts, NEW_TOKENS + 5)
        chain4 = simulate(draft, cat_prompts, cat_conts, 4, 1, NEW_TOKENS)
        beam = simulate(draft, cat_prompts, cat_conts, 4, 4, NEW_TOKENS)
        other[category] = {"prompts": len(cat_prompts), "chain4_tokens_per_step": round(chain4, 3),
                           "d4w4_tokens_per_step": round(beam, 3)}
    out["acceptance"] = {"chain_tokens_per_step": chains, "beam_trees": trees,
                         "chain4_accepted_fraction": round((chains["4"] - 1) / 4, 3), "other_categories": other}
    print(json.dumps(out["acceptance"], indent=2))
    return out
