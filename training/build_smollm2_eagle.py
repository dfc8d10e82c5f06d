"""Build an EAGLE-style draft head for SmolLM2-135M-Instruct: one decoder layer over the target's own features.

    python -m training.build_smollm2_eagle                  # every stage not yet done
    python -m training.build_smollm2_eagle --stage train    # one stage (redone even if done)

Stages; outputs under build/smollm2_eagle/, the head in models/smollm2-eagle/:
  features  the target's greedy answers to the training prompts (training/smollm2_prompts.py) and its
            last hidden state (the final norm's output: what its LM head reads) at every position of
            prompt and answer, captured while it generates -> features.pt
  train     the head learns, by teacher forcing, to predict the target's next feature and next-token
            distribution from (feature, next token); the distribution is the target's own LM head
            over the head's reduced vocabulary -> models/smollm2-eagle/
  evaluate  tokens per target pass of greedy chain and beam-tree speculation on held-out prompts,
            through the runtime that serves it, and the head's step cost against the target's
            -> report.json
The features stage costs one batched generation; the train stage never runs the target.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.draft.eagle import EagleDrafter
from specserve.draft.eagle_head import EagleHead, load_for_target, target_parts
from specserve.shared.runtime.model_store import resolve
from training import corpus, smollm2_prompts
from training.stages import build_main

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "smollm2_eagle"
OUT = ROOT / "models" / "smollm2-eagle"
TARGET = "smollm2-135m-instruct"
SEED = 4321
CODE_PROMPTS = 500
ANSWER_TOKENS = 128
GEN_BATCH = 32
VOCAB_SIZE = 49152
STAGES = ("features", "train", "evaluate")
DRAFT_VOCAB = 8192  # the most frequent answer tokens; the head's cost is mostly its rows
INTERMEDIATE = 1024
EPOCHS = 4
BATCH_ENTRIES = 4096  # entries per step (sequences of similar length, padded)
LR = 1e-3
FEATURE_WEIGHT = 0.1  # the feature regression beside the distribution's cross-entropy
CHAINS = (1, 2, 3, 4, 5, 6)
TREES = ((4, 2), (4, 4))  # (depth, width) of beam trees; AdaServe selects its trees from these
EVAL_PROMPTS = 64
EVAL_TOKENS = 64
NOISE = 0.05  # Gaussian noise on the true input features, times their RMS
UNROLL = 2  # training-time test: steps the head is unrolled on its own predictions (4: models/README.md)


def chat_ids(tok, prompt: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def prompts(held_out: bool) -> list[str]:
    files, _ = corpus.load_corpus()
    return [p for p in smollm2_prompts.build(files, SEED, CODE_PROMPTS) if smollm2_prompts.held_out(p) == held_out]


def stage_features(state: dict, limit: int | None) -> None:
    target_dir = resolve(TARGET)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    train = prompts(held_out=False)
    train = train[:limit] if limit else train
    order = sorted(range(len(train)), key=lambda i: len(train[i]))  # similar lengths: less padding
    steps: list[torch.Tensor] = []
    model.model.norm.register_forward_hook(lambda _m, _i, out: steps.append(out.detach().to(torch.bfloat16)))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    samples, t0, produced = [], time.perf_counter(), 0
    bar = tqdm(total=len(train), desc="features", unit="prompt", dynamic_ncols=True)
    for b in range(0, len(order), GEN_BATCH):
        ids = [chat_ids(tok, train[i]) for i in order[b:b + GEN_BATCH]]
        width = max(map(len, ids))
        pad = tok.pad_token_id
        x = torch.tensor([[pad] * (width - len(s)) + s for s in ids])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
        steps.clear()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(x, attention_mask=mask, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                 pad_token_id=pad)
        feats = torch.cat(steps, dim=1)  # [batch, width + generated - 1, hidden]
        for row, s in enumerate(ids):
            answer = out[row, width:].tolist()
            n = next((j + 1 for j, t in enumerate(answer) if t in eos), len(answer))
            # features exist for every fed position: the prompt and the answer but its last token
            samples.append({"tokens": torch.tensor(s + answer[:n], dtype=torch.int32), "prompt": len(s),
                            "features": feats[row, width - len(s):width + n - 1].clone()})
            produced += n
        bar.update(len(ids))
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - t0):.0f}")
    bar.close()
    torch.save(samples, BUILD / "features.pt")
    state["features"] = {"prompts": len(samples), "answer_tokens": produced,
                         "positions": sum(len(s["features"]) for s in samples),
                         "max_answer_tokens": ANSWER_TOKENS, "batch": GEN_BATCH, "dtype": "bfloat16 autocast",
                         "wall_s": round(time.perf_counter() - t0, 1)}


def draft_vocab(samples: list[dict]) -> tuple[torch.Tensor, float]:
    """The DRAFT_VOCAB most frequent answer tokens, and the share of answer tokens they cover."""
    counts = torch.zeros(VOCAB_SIZE, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s["tokens"][s["prompt"]:].long(), minlength=VOCAB_SIZE)
    top = torch.topk(counts, DRAFT_VOCAB).indices.sort().values
    return top, counts[top].sum().item() / counts.sum().item()


def _batches(samples: list[dict], epoch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED + epoch)
    perm = torch.randperm(len(samples), generator=g).tolist()
    window = 256  # sorted within windows: little padding, still shuffled
    order = [i for w in range(0, len(perm), window)
             for i in sorted(perm[w:w + window], key=lambda i: len(samples[i]["features"]))]
    batches, cur, width = [], [], 0
    for i in order:
        width = max(width, len(samples[i]["features"]))
        if cur and width * (len(cur) + 1) > BATCH_ENTRIES:
            batches.append(cur)
            cur, width = [], len(samples[i]["features"])
        cur.append(i)
    batches.append(cur)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def _train_loss(head: EagleHead, samples: list[dict]) -> tuple[torch.Tensor, dict]:
    """Teacher forcing, unrolled UNROLL steps (EAGLE-3's training-time test): step 1 reads the target's
    features; step j reads step j-1's prediction at the same base entry, as the j-th node of a chain
    does. Entry e's step j sits at position e + j - 1 and attends to the true entries 0..e and to its
    own chain's steps 2..j (the step-diagonal keys)."""
    lens = [len(s["features"]) for s in samples]
    b, t = len(samples), max(lens)
    feats = torch.zeros(b, t, head.hidden_size)
    toks = torch.zeros(b, t, dtype=torch.int64)
    for r, s in enumerate(samples):
        feats[r, :lens[r]] = s["features"].float()
        toks[r, :lens[r]] = s["tokens"][1:lens[r] + 1].long()
    valid = torch.arange(t)[None, :] < torch.tensor(lens)[:, None] - 1  # entry e has a target: f_{e+1}
    rms = feats.pow(2).mean().sqrt()
    g = head.heads // head.kv_heads
    pos = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    with torch.no_grad():
        target_p = head.logits(feats[:, 1:]).softmax(-1)  # [b, t-1, V']: the target's distribution
        target_top = target_p.argmax(-1)
    losses, stats = [], {}
    true_k = true_v = None  # step 1's keys and values (the true entries), repeated over query-head groups
    chain_k: list[torch.Tensor] = []  # steps 2..j-1's keys and values, by base entry
    chain_v: list[torch.Tensor] = []
    h = feats + torch.randn_like(feats) * NOISE * rms  # step 1's input features: the target's, noised
    for j in range(1, UNROLL + 1):
        n = t - j + 1  # base entries 0..n-1 (entry e's step j sits at position e + j - 1)
        x = head.inputs(h[:, :n], toks[:, j - 1:j - 1 + n])
        q, k, v = (z.view(b, n, *z.shape[1:]) for z in head.qkv(x.reshape(b * n, -1), pos[j - 1:j - 1 + n].repeat(b)))
        kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        if true_k is None:
            true_k, true_v = kr, vr
        s_true = torch.einsum("bnhd,bmhd->bhnm", q, true_k[:, :n]) * head.scale
        s_true = s_true.masked_fill(~causal[:n, :n], float("-inf"))
        own = [*(c[:, :n] for c in chain_k), kr] if j > 1 else []
        diag = [torch.einsum("bnhd,bnhd->bhn", q, c)[..., None] * head.scale for c in own]
        a = torch.cat((s_true, *diag), -1).float().softmax(-1).to(vr.dtype)
        o = torch.einsum("bhnm,bmhd->bnhd", a[..., :n], true_v[:, :n])
        for i, c in enumerate([*(c[:, :n] for c in chain_v), vr] if j > 1 else []):
            o = o + a[..., n + i].transpose(1, 2)[..., None] * c
        h = head.finish(x, o.reshape(b, n, -1))
        if j > 1:
            chain_k.append(kr)
            chain_v.append(vr)
        # step j at base e predicts f_{e+j} and the target's distribution there
        m = valid[:, j - 1:t - 1]
        pred = h[:, :t - j][m]
        logp = F.log_softmax(head.logits(pred), -1)
        ce = -(target_p[:, j - 1:][m] * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(pred.float(), feats[:, j:][m])
        losses.append(ce + FEATURE_WEIGHT * reg)
        stats[f"s{j}_acc"] = (logp.argmax(-1) == target_top[:, j - 1:][m]).float().mean().item()
    return sum(losses) / len(losses), stats | {"entries": int(valid.sum())}


def new_head(target_dir: str, vocab: torch.Tensor) -> EagleHead:
    cfg, embed, lm_head = target_parts(target_dir)
    head = EagleHead(cfg, INTERMEDIATE, vocab)
    head.load_target(embed, lm_head)
    with torch.no_grad():  # the stream starts as the input feature; the layer learns the step to the next
        head.fc.weight.zero_()
        head.fc.weight[:, cfg.hidden_size:].copy_(torch.eye(cfg.hidden_size))
        head.fc.weight[:, :cfg.hidden_size].normal_(0, 0.02)
    return head


def stage_train(state: dict) -> None:
    target_dir = resolve(TARGET)
    samples = torch.load(BUILD / "features.pt", weights_only=False)
    vocab, coverage = draft_vocab(samples)
    torch.manual_seed(SEED)
    head = new_head(target_dir, vocab)
    params = [p for p in head.parameters() if p.requires_grad]
    steps_per_epoch = len(_batches(samples, 0))
    total = steps_per_epoch * EPOCHS
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=total, pct_start=0.05)
    print(f"[train] {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters, {total} steps; "
          f"draft vocabulary {DRAFT_VOCAB} covers {coverage:.3f} of answer tokens", flush=True)
    log, t0 = [], time.perf_counter()
    head.train()
    bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
    for step in range(total):
        batch = _batches(samples, step // steps_per_epoch)[step % steps_per_epoch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = _train_loss(head, [samples[i] for i in batch])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.append({"step": step + 1, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in stats.items()},
                    "time_s": round(time.perf_counter() - t0, 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{f"s{j}": f"{stats[f's{j}_acc']:.2f}" for j in (1, UNROLL)})
    bar.close()
    head.eval()
    if OUT.exists():
        shutil.rmtree(OUT)
    head.save(OUT, TARGET, int8=True)
    (BUILD / "train_log.json").write_text(json.dumps(log))
    tail = log[-20:]
    state["train"] = {"trained_parameters": sum(p.numel() for p in params), "intermediate_size": INTERMEDIATE,
                      "draft_vocab": DRAFT_VOCAB, "vocab_coverage": round(coverage, 4), "epochs": EPOCHS,
                      "steps": total, "lr": LR, "wall_s": log[-1]["time_s"],
                      "final_loss": round(sum(e["loss"] for e in tail) / len(tail), 4),
                      "unroll": UNROLL,
                      "final_top1": {f"s{j}_acc": round(sum(e[f"s{j}_acc"] for e in tail) / len(tail), 4)
                                     for j in range(1, UNROLL + 1)}}


def _held_out_runs(target_dir: str) -> list[dict]:
    """Held-out prompts with the target's greedy continuation (float32) and its features at every position."""
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    runs = []
    for p in tqdm(prompts(held_out=True)[:EVAL_PROMPTS], desc="held-out answers", unit="prompt"):
        ids = chat_ids(tok, p)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=EVAL_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            n = next((j + 1 for j, t in enumerate(out) if t in eos), len(out))
            seq = torch.tensor([ids + out[:n]])
            feats = model.model(input_ids=seq).last_hidden_state[0]  # after the final norm
        runs.append({"tokens": seq[0].tolist(), "prompt": len(ids), "features": feats})
    return runs


def simulate(drafter: EagleDrafter, runs: list[dict], depth: int, width: int) -> float:
    """Tokens per target pass of greedy speculation with trees of `depth` x `width` over the runs, each
    measured up to the end of its continuation (the bonus token included)."""
    emitted = passes = 0
    for r, run in enumerate(runs):
        toks, feats, n = run["tokens"], run["features"], run["prompt"]  # n: committed tokens
        rid = f"eval-{r}"
        drafter.append([(rid, feats[:n], torch.tensor(toks[1:n + 1]))])  # the prefill's entries
        n += 1  # the prefill emits the first token
        while n < len(toks):
            trees, _ = drafter.speculate([(rid, toks[n - 1], depth, width)])
            tree = trees[rid]
            node, accepted = 0, 0
            while n + accepted < len(toks):
                child = next((i for i, p in enumerate(tree.parents) if p == node and
                              tree.tokens[i] == toks[n + accepted]), None)
                if child is None:
                    break
                node, accepted = child, accepted + 1
            step = min(accepted + 1, len(toks) - n)
            start = drafter.entries(rid)  # entries so far: features 0 .. start-1 are in
            drafter.append([(rid, feats[start:n + step - 1], torch.tensor(toks[start + 1:n + step]))])
            emitted, passes, n = emitted + step, passes + 1, n + step
        drafter.release(rid)
    return emitted / passes


def head_cost(target_dir: str, drafter: EagleDrafter, context: int = 128, rounds: int = 40) -> dict:
    """Median times, alternating: the target's 1-token decode at `context` tokens of KV through the
    served runtime; one head step (a chain of 4 steps, divided by 4); one entry appended."""
    from specserve.shared.runtime.batch import Chunk, Tree
    from specserve.shared.runtime.runner import ModelRunner

    target = ModelRunner.from_dir(Path(target_dir), num_blocks=64)
    hidden = drafter.head.hidden_size
    times: dict[str, list[float]] = {"target": [], "head_step": [], "append": []}
    with torch.inference_mode():
        target.forward([Chunk("cost", list(range(1, context + 1)))])
        drafter.append([("cost", torch.randn(context, hidden), torch.arange(1, context + 1))])
        for _ in range(rounds):
            t0 = time.perf_counter()
            target.forward([Tree("cost", [5], [-1])])
            times["target"].append(time.perf_counter() - t0)
            target.discard_tree("cost")
            t0 = time.perf_counter()
            drafter.speculate([("cost", 5, 4, 1)])
            times["head_step"].append((time.perf_counter() - t0) / 4)
            drafter.truncate("cost", context - 1)
            t0 = time.perf_counter()
            drafter.append([("cost", torch.randn(1, hidden), torch.tensor([7]))])
            times["append"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"context": context, "threads": torch.get_num_threads(), "target_ms": round(med["target"], 3),
            "head_step_ms": round(med["head_step"], 3), "append_ms": round(med["append"], 3),
            "step_ratio": round(med["target"] / med["head_step"], 2)}


def stage_evaluate(state: dict) -> None:
    target_dir = resolve(TARGET)
    head = load_for_target(OUT, target_dir)
    head.to_cpu_kernels()  # as the draft service runs it
    drafter = EagleDrafter(head)
    runs = _held_out_runs(target_dir)
    chains = {str(k): round(simulate(drafter, runs, k, 1), 3) for k in tqdm(CHAINS, desc="chains", unit="k")}
    trees = {f"d{d}w{w}": round(simulate(drafter, runs, d, w), 3)
             for d, w in tqdm(TREES, desc="beam trees", unit="tree")}
    state["evaluate"] = {"held_out_prompts": len(runs), "tokens": EVAL_TOKENS,
                         "answer_tokens": sum(len(r["tokens"]) - r["prompt"] for r in runs),
                         "cost": head_cost(target_dir, drafter), "chain_tokens_per_pass": chains,
                         "beam_tokens_per_pass": trees}
    print(json.dumps(state["evaluate"], indent=1), flush=True)


def main(argv: list[str] | None = None) -> int:
    stages = {"features": lambda state, args: stage_features(state, args.limit),
              "train": lambda state, _: stage_train(state),
              "evaluate": lambda state, _: stage_evaluate(state)}
    outputs = {"features": BUILD / "features.pt", "train": OUT / "eagle.safetensors"}
    return build_main(argv, __doc__, stages, outputs, BUILD, OUT)


if __name__ == "__main__":
    sys.exit(main())
