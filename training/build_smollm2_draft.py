"""Build a trained draft for SmolLM2-135M-Instruct, distilled from the target's own answers.

    python -m training.build_smollm2_draft                 # every stage not yet done
    python -m training.build_smollm2_draft --stage distill # one stage (redone even if done)

Stages; outputs under build/smollm2_draft/, the model in models/smollm2-draft/:
  answers   the target's greedy answers to the training prompts (training/smollm2_prompts.py), with
            its top-16 next-token log-probabilities at every answer position, in batches
            -> answers.pt
  distill   a small Llama (the draft) learns those distributions: soft cross-entropy on the answer
            positions. Its tied embedding starts as the target's, projected onto its top principal
            directions, so it starts with the target's token geometry; stored as int8 rows with a
            float32 scale per row, xz-compressed, and served as what that unpacks to (bfloat16)
            -> models/smollm2-draft/ (model.safetensors.xz)
  evaluate  tokens per step of greedy chain speculation (k = 1..8) on held-out prompts, through our
            own runtime, and the draft/target cost of a decode -> report.json
Greedy answers are what a greedy chain is checked against, so they are what the draft learns. The
answers stage costs one batched generation; the distill stage never runs the target. Progress bars
on each; an interrupted distill resumes from its checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, LogitsProcessor

from specserve.shared.runtime.model_store import pack_int8_rows, resolve
from training import corpus, smollm2_prompts
from training.stages import build_main

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "smollm2_draft"
OUT = ROOT / "models" / "smollm2-draft"
TARGET = "smollm2-135m-instruct"
SEED = 4321
TOP_K = 16  # teacher log-probabilities kept per answer position
ANSWER_TOKENS = 128  # longest answer generated per prompt
GEN_BATCH = 32
CODE_PROMPTS = 500
# Two layers (an induction circuit for copying) over a 256-wide stream; the tied 49,152-token head is
# most of its cost.
DRAFT_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)
EPOCHS = 4
BATCH = 8  # sequences per step
LR = 2e-3
CHAINS = tuple(range(1, 9))
EVAL_PROMPTS = 64
EVAL_TOKENS = 64
STAGES = ("answers", "distill", "evaluate")


class _TopK(LogitsProcessor):
    """Keeps the top-K log-probabilities of every generation step (raw logits: greedy has no warpers)."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = torch.topk(F.log_softmax(scores.float(), dim=-1), TOP_K, dim=-1)
        self.values.append(top.values.to(torch.float16))
        self.indices.append(top.indices.to(torch.int32))
        return scores


def _chat_ids(tok, prompt: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def stage_answers(state: dict, limit: int | None) -> None:
    target_dir = resolve(TARGET)
    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    files, _ = corpus.load_corpus()
    prompts = [p for p in smollm2_prompts.build(files, SEED, CODE_PROMPTS) if not smollm2_prompts.held_out(p)]
    prompts = prompts[:limit] if limit else prompts
    # batches of similar prompt length waste less on padding
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    samples, t0, produced = [], time.perf_counter(), 0
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    bar = tqdm(total=len(prompts), desc="answers", unit="prompt", dynamic_ncols=True)
    for b in range(0, len(order), GEN_BATCH):
        ids = [_chat_ids(tok, prompts[i]) for i in order[b:b + GEN_BATCH]]
        width = max(map(len, ids))
        pad = tok.pad_token_id
        x = torch.tensor([[pad] * (width - len(s)) + s for s in ids])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
        keep = _TopK()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(x, attention_mask=mask, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                 pad_token_id=pad, logits_processor=[keep])
        values, indices = torch.stack(keep.values, 1), torch.stack(keep.indices, 1)
        for row, s in enumerate(ids):
            answer = out[row, width:].tolist()
            n = next((j + 1 for j, t in enumerate(answer) if t in eos), len(answer))
            samples.append({"prompt": s, "answer": answer[:n], "top_values": values[row, :n].clone(),
                            "top_indices": indices[row, :n].clone()})
            produced += n
        bar.update(len(ids))
        bar.set_postfix(tok_s=f"{produced / (time.perf_counter() - t0):.0f}")
    bar.close()
    torch.save(samples, BUILD / "answers.pt")
    state["answers"] = {"prompts": len(samples), "answer_tokens": produced, "max_answer_tokens": ANSWER_TOKENS,
                        "batch": GEN_BATCH, "dtype": "bfloat16 autocast", "wall_s": round(time.perf_counter() - t0, 1)}


def draft_config(target: LlamaConfig) -> LlamaConfig:
    return LlamaConfig(vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
                       rope_parameters=dict(target.rope_parameters), rms_norm_eps=target.rms_norm_eps,
                       tie_word_embeddings=True, bos_token_id=target.bos_token_id,
                       eos_token_id=target.eos_token_id, pad_token_id=target.pad_token_id, **DRAFT_SHAPE)


def _init_embedding(draft: LlamaForCausalLM, target_dir: str) -> None:
    """The target's embedding projected onto its top principal directions, at the draft's width."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    emb = target.get_input_embeddings().weight.detach()
    _, _, v = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    proj = emb @ v[:DRAFT_SHAPE["hidden_size"]].T
    proj *= 1.0 / proj.pow(2).mean().sqrt()
    with torch.no_grad():  # at RMS 0.05, so that the tied head's first logits stay small
        draft.get_input_embeddings().weight.copy_(proj * 0.05)


def _batches(samples: list[dict], epoch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED + epoch)
    perm = torch.randperm(len(samples), generator=g).tolist()
    # sort each window of 16 batches by length: less padding, still shuffled
    window = BATCH * 16
    order = [i for w in range(0, len(perm), window)
             for i in sorted(perm[w:w + window], key=lambda i: len(samples[i]["prompt"]) + len(samples[i]["answer"]))]
    batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def _loss(draft: LlamaForCausalLM, samples: list[dict], pad: int) -> tuple[torch.Tensor, int]:
    """Soft cross-entropy against the target's top-K log-probabilities, over answer positions only."""
    seqs = [s["prompt"] + s["answer"] for s in samples]
    width = max(map(len, seqs))
    x = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])  # right padding: causal, so no mask
    hidden = draft.model(input_ids=x).last_hidden_state
    rows, cols, values, indices = [], [], [], []
    for r, s in enumerate(samples):
        p = len(s["prompt"])
        n = len(s["answer"])
        rows += [r] * n
        cols += range(p - 1, p - 1 + n)  # position p - 1 predicts answer token 0
        values.append(s["top_values"].float())
        indices.append(s["top_indices"].long())
    h = hidden[torch.tensor(rows), torch.tensor(cols)]
    logp = F.log_softmax(draft.lm_head(h).float(), dim=-1)
    t_logp, t_idx = torch.cat(values), torch.cat(indices)
    loss = -(t_logp.exp() * logp.gather(1, t_idx)).sum(-1).mean()
    return loss, len(rows)


def stage_distill(state: dict) -> None:
    target_dir = resolve(TARGET)
    target_cfg = LlamaConfig.from_pretrained(target_dir)
    samples = torch.load(BUILD / "answers.pt", weights_only=False)
    torch.manual_seed(SEED)
    draft = LlamaForCausalLM(draft_config(target_cfg))
    _init_embedding(draft, target_dir)
    params = sum(p.numel() for p in draft.parameters())
    steps_per_epoch = len(_batches(samples, 0))
    total = steps_per_epoch * EPOCHS
    recipe = hashlib.sha256(json.dumps([DRAFT_SHAPE, EPOCHS, BATCH, LR, SEED, len(samples)]).encode()).hexdigest()[:10]
    ckpt = BUILD / f"distill-{recipe}.ckpt"
    opt = torch.optim.AdamW(draft.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=total, pct_start=0.05)
    step, log, elapsed = 0, [], 0.0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, log, elapsed = st["step"], st["log"], st["elapsed"]
    print(f"[distill] {params / 1e6:.2f}M parameters, {total} steps over {len(samples)} answers", flush=True)
    draft.train()
    t0 = time.perf_counter() - elapsed
    bar = tqdm(total=total, initial=step, desc="distill", unit="step", dynamic_ncols=True)
    epoch, batches = -1, []
    while step < total:
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            batches = _batches(samples, epoch)
        batch = batches[step % steps_per_epoch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, tokens = _loss(draft, [samples[i] for i in batch], target_cfg.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        log.append({"step": step, "loss": round(loss.item(), 4), "tokens": tokens,
                    "time_s": round(time.perf_counter() - t0, 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 100 == 0 or step == total:
            torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "log": log, "elapsed": time.perf_counter() - t0}, ckpt)
    bar.close()
    draft.eval()
    if OUT.exists():
        shutil.rmtree(OUT)
    draft.to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    pack_int8_rows(OUT / "model.safetensors")  # what is committed; the bfloat16 file becomes what it unpacks to
    draft.generation_config.save_pretrained(OUT)
    (BUILD / "distill_log.json").write_text(json.dumps(log))
    state["distill"] = {"parameters": params, "config": DRAFT_SHAPE, "epochs": EPOCHS, "steps": total,
                        "train_tokens": sum(e["tokens"] for e in log), "wall_s": log[-1]["time_s"],
                        "final_loss": sum(e["loss"] for e in log[-20:]) / len(log[-20:]), "lr": LR}


def stage_evaluate(state: dict) -> None:
    from specserve.shared.runtime.generate import generate
    from specserve.shared.runtime.runner import ModelRunner
    from training.evaluate import forward_cost, simulate

    target_dir = resolve(TARGET)
    tok = AutoTokenizer.from_pretrained(target_dir)
    files, _ = corpus.load_corpus()
    held = [p for p in smollm2_prompts.build(files, SEED, CODE_PROMPTS) if smollm2_prompts.held_out(p)]
    held = held[:EVAL_PROMPTS]
    prompts = {str(i): _chat_ids(tok, p) for i, p in enumerate(held)}
    target = ModelRunner.from_dir(Path(target_dir), num_blocks=4096)
    draft = ModelRunner.from_dir(OUT, num_blocks=4096)
    cost = forward_cost(target, draft)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    conts = generate(target, prompts, EVAL_TOKENS, stop_ids={eos})
    limit = {r: len(c) for r, c in conts.items()}  # an answer that ends early is measured up to its end
    chains = {str(k): round(simulate(draft, prompts, conts, k, 1, limit), 3)
              for k in tqdm(CHAINS, desc="chains", unit="k")}
    trees = {f"d{d}w{w}": round(simulate(draft, prompts, conts, d, w, limit), 3)
             for d, w in tqdm(((4, 2), (4, 4)), desc="beam trees", unit="tree")}
    state["evaluate"] = {"held_out_prompts": len(prompts), "tokens": EVAL_TOKENS,
                         "answer_tokens": sum(limit.values()), "forward_cost": cost,
                         "chain_tokens_per_step": chains, "beam_tokens_per_step": trees}
    print(json.dumps(state["evaluate"], indent=1), flush=True)


def main(argv: list[str] | None = None) -> int:
    stages = {"answers": lambda state, args: stage_answers(state, args.limit),
              "distill": lambda state, _: stage_distill(state),
              "evaluate": lambda state, _: stage_evaluate(state)}
    outputs = {"answers": BUILD / "answers.pt", "distill": OUT / "model.safetensors"}
    return build_main(argv, __doc__, stages, outputs, BUILD, OUT)


if __name__ == "__main__":
    sys.exit(main())
