"""An untrained EAGLE head over the demo target, for the EAGLE tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from specserve.draft.eagle_head import EagleHead, load_for_target
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.model_store import MODELS

TARGET = MODELS / "target"


def make_head(out, seed: int = 0, vocab: int = 512):
    """An untrained head over the demo target (random layer; the target's embedding and LM head), saved."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dir(TARGET)
    head = EagleHead(cfg, 128, torch.arange(vocab))
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    head.load_target(hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach())
    head.save(out, str(TARGET))
    return load_for_target(out, TARGET)
