"""RotaryEmbedding.looked_up (shared/runtime/rope.py): the compiled CPU pass's table of cos and sin by position
gives each position the floats `cos_sin` computes, whatever else is in the pass and however the table grew."""

from __future__ import annotations

import random

import torch

from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.rope import RotaryEmbedding


def rope(**params: object) -> RotaryEmbedding:
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                 "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "intermediate_size": 512, "num_hidden_layers": 1, "vocab_size": 64,
                                 "max_position_embeddings": 8192, "rope_theta": 10000.0, **params})
    return RotaryEmbedding(cfg)


def test_the_table_gives_each_position_the_floats_cos_sin_computes():
    rng = random.Random(1)
    for params in ({}, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}):
        r = rope(**params)
        for n in (1, 3, 17, 300, 700):  # a decode, a tree, chunks; each pass may grow the table
            positions = torch.tensor([rng.randrange(0, 6000) for _ in range(n)], dtype=torch.int64)
            got, want = r.looked_up(positions, torch.float32), r.cos_sin(positions, torch.float32)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and torch.equal(g, w), (params, n)
        assert r._table is not None and r._table[0].shape[0] == 8192  # grown by doubling past the largest asked
