"""The training loop shared by target pre-training and draft distillation.

bfloat16 autocast over float32 master weights, AdamW, linear warmup then cosine decay, gradient
clipping. Each step's batch depends only on (seed, step), and a checkpoint is written every
`ckpt_every` steps, so an interrupted run resumes where it stopped and ends bit-identical.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.data import random_windows

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Phase:
    seq_len: int  # tokens per window
    batch_size: int  # windows per step
    steps: int


@dataclass(frozen=True)
class Schedule:
    phases: tuple[Phase, ...]
    lr: float
    warmup: int  # steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def phase_at(self, step: int) -> Phase:
        for p in self.phases:
            if step < p.steps:
                return p
            step -= p.steps
        raise IndexError(step)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.total_steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def cross_entropy_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def distillation_loss(teacher: torch.nn.Module) -> LossFn:
    """KL(teacher || student) per token: the student learns the teacher's whole next-token distribution."""
    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
        s_logp = F.log_softmax(model(input_ids=x).logits.float(), dim=-1)
        return F.kl_div(s_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
    return loss


def _optimizer(model: torch.nn.Module, sched: Schedule) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": sched.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=sched.lr, betas=(0.9, 0.95))


def train(model: torch.nn.Module, stream: np.ndarray, sched: Schedule, loss_fn: LossFn, *, seed: int,
          ckpt_path: Path, desc: str, ckpt_every: int = 50) -> list[dict]:
    """Run the schedule (resuming from ckpt_path if present); return the loss log."""
    opt = _optimizer(model, sched)
    step, log, elapsed = 0, [], 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log, elapsed = state["step"], state["log"], state["elapsed"]
    model.train()
    bar = tqdm(total=sched.total_steps, initial=step, desc=desc, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter() - elapsed
    while step < sched.total_steps:
        phase = sched.phase_at(step)
        lr = sched.lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        w = random_windows(stream, phase.batch_size, phase.seq_len, seed, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), sched.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        log.append({"step": step, "loss": round(loss.item(), 4), "lr": lr, "seq_len": phase.seq_len,
                    "tokens": phase.batch_size * phase.seq_len, "time_s": round(time.perf_counter() - t0, 1)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", seq=phase.seq_len)
        if step % ckpt_every == 0 or step == sched.total_steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                        "elapsed": time.perf_counter() - t0}, ckpt_path)
    bar.close()
    model.eval()
    return log
