"""The SmolLM2 draft's training inputs (training/smollm2_prompts.py, training/build_smollm2_draft.py), on
small data: the prompt set is deterministic and its held-out split is disjoint from what is trained on,
code prompts come only from the corpus's training files, and the distillation loss is the soft
cross-entropy against the kept top-K log-probabilities at the answer positions, and nowhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from training import build_smollm2_draft as build
from training import smollm2_prompts
from training.corpus import SourceFile
from training.stages import run_stages

LONG = "def long(x):\n" + "    x += 1\n" * 30 + "    return x\n"
FILES = [SourceFile(f"pkg/mod{i}.py", f"import os\n\n\ndef f{i}(a, b):\n    c = a + b\n    return c * {i}\n\n\n{LONG}")
         for i in range(40)]


def test_prompts_are_deterministic_and_the_held_out_split_is_disjoint():
    a = smollm2_prompts.build(FILES, seed=1, code_prompts=10)
    assert a == smollm2_prompts.build(FILES, seed=1, code_prompts=10)
    held = [p for p in a if smollm2_prompts.held_out(p)]
    train = [p for p in a if not smollm2_prompts.held_out(p)]
    assert held and train and not set(held) & set(train)
    assert 0.05 < len(held) / len(a) < 0.15
    assert len(a) == len(smollm2_prompts.TEMPLATES) * len(smollm2_prompts.TOPICS) + 10


def test_code_prompts_hold_short_functions_of_training_files_only():
    code = [p for p in smollm2_prompts.build(FILES, seed=2, code_prompts=100) if "```python" in p]
    trained = {f.path for f in FILES if not f.held_out}
    assert code and all("def long" not in p for p in code)  # longer than the limit
    for p in code:
        i = int(p.split("def f", 1)[1].split("(", 1)[0])
        assert f"pkg/mod{i}.py" in trained


def test_the_loss_is_soft_cross_entropy_on_answer_positions_only():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    k = build.TOP_K
    samples = []
    for plen, alen in ((3, 2), (5, 4)):
        vals = F.log_softmax(torch.randn(alen, 50), -1).topk(k)
        samples.append({"prompt": list(range(1, plen + 1)), "answer": list(range(10, 10 + alen)),
                        "top_values": vals.values.half(), "top_indices": vals.indices.int()})
    loss, n = build._loss(model, samples, pad=0)
    assert n == 6
    terms = []
    for s in samples:
        seq = torch.tensor([s["prompt"] + s["answer"]])
        logp = F.log_softmax(model(input_ids=seq).logits[0].float(), -1)
        p = len(s["prompt"])
        for j in range(len(s["answer"])):
            t = s["top_values"][j].float()
            terms.append(-(t.exp() * logp[p - 1 + j, s["top_indices"][j].long()]).sum())
    assert torch.allclose(loss, torch.stack(terms).mean(), atol=1e-5)


def test_the_stage_loop_runs_what_is_not_done_or_what_is_chosen(tmp_path):
    ran: list[str] = []
    state = {"n": 0}

    def run(stage: str) -> None:
        ran.append(stage)
        state["n"] += 1

    report = tmp_path / "report.json"
    run_stages(("a", "b", "c"), None, lambda s: s == "b", run, state, report)
    assert ran == ["a", "c"] and '"n": 2' in report.read_text()
    ran.clear()
    run_stages(("a", "b", "c"), ["b"], lambda s: True, run, state, report)
    assert ran == ["b"]
