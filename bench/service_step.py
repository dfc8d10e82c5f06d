"""Step messages through the draft and target services: transport overhead and beam-search cost.

    .venv/bin/python bench/service_step.py [--quick] [--requests 64] [--steps 20] [--out FILE.md]

(a) Transport round trip. Both services run as processes on localhost (1 torch thread each, bundled
    demo pair, float32). 64 requests are prefilled with 64-token prompts from the short workload,
    then each step: one Speculate call (64 entries, depth 5 x width 3 = 16-node trees) and one
    Forward call verifying all 64 trees (every node). For each call the client's wall time (encode,
    socket, service, decode) is set beside the time the service spent inside the call; the
    difference is the transport and event-loop overhead. A Health call gives the bare round trip,
    and in-process encode+decode of the same frames gives the serialization share.
(b) Beam speculation vs (n, d, w), in process (DraftEngine, no sockets, 1 thread): n requests with
    64 committed tokens each; each timed call appends 1 new token per request (catch-up) and runs
    d beam steps of width w. Reported: median beam_ms and catchup_ms over the repeats.

Medians over all steps or repeats. The machine, torch version and commit go into the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.cli.main import BUNDLED_TARGET
from specserve.shared.host.launch import ServiceProcess
from specserve.shared.wire.messages import SamplingSpec, Speculate, SpeculateEntry
from specserve.shared.wire.service_client import DraftClient, PrefillItem, SpeculateItem, TargetClient, VerifyItem
from specserve.shared.wire.transport import decode_tensors, encode_frame

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 64


def _prompts(n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUNDLED_TARGET / "tokenizer.json"))
    with open(ROOT / "bench" / "workloads" / "short.jsonl") as f:
        records = [json.loads(line) for line in f]
    ids = [tok.encode(r["prompt"], add_special_tokens=False).ids for r in records]
    long_enough = [x[:PROMPT_TOKENS] for x in ids if len(x) >= PROMPT_TOKENS]
    return [long_enough[i % len(long_enough)] for i in range(n)]


def _codec_ms(body, tensors, rounds: int = 50) -> float:
    """In-process encode + decode of one frame (no socket), median ms."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        buffers = encode_frame(1, body, tensors)
        payload = bytearray(b"".join(bytes(b) for b in buffers[2:]))
        import msgspec

        from specserve.shared.wire.transport import Header

        header = msgspec.msgpack.decode(buffers[1], type=Header)
        decode_tensors(header.tensors, payload)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def transport(n: int, steps: int, depth: int, width: int) -> dict:
    target = ServiceProcess("target", "--kv-blocks", "2048")
    draft = ServiceProcess("draft", "--kv-blocks", "2048")
    try:
        tc, dc = await TargetClient.connect(target.address), await DraftClient.connect(draft.address)
        prompts = _prompts(n)
        rids = [f"r{i}" for i in range(n)]
        outs, _ = await tc.forward([PrefillItem(r, 0, 0, p, True, SamplingSpec()) for r, p in zip(rids, prompts)])
        committed = {r: p + o.tokens for r, p, o in zip(rids, prompts, outs)}
        unsent = dict(committed)
        rows = {"health": [], "spec_wall": [], "spec_service": [], "spec_beam": [], "fwd_wall": [],
                "fwd_service": [], "fwd_pass": [], "nodes": [], "accepted": []}
        spec_frame = None
        for step in tqdm(range(1, steps + 1), desc="steps", unit="step"):
            t0 = time.perf_counter()
            await dc.health()
            rows["health"].append((time.perf_counter() - t0) * 1e3)
            items = [SpeculateItem(r, step, unsent[r], len(committed[r]), depth, width) for r in rids]
            t0 = time.perf_counter()
            cands, sreply = await dc.speculate(items)
            rows["spec_wall"].append((time.perf_counter() - t0) * 1e3)
            rows["spec_service"].append(sreply.total_ms)
            rows["spec_beam"].append(sreply.beam_ms)
            if spec_frame is None:
                spec_frame = ([SpeculateEntry(i.rid, i.step, len(i.new_tokens), i.num_committed, depth, width)
                               for i in items], torch.tensor([t for i in items for t in i.new_tokens],
                                                             dtype=torch.int32))
            verify = [VerifyItem(r, step, len(committed[r]), c.tokens, c.parents) for r, c in zip(rids, cands)]
            rows["nodes"].append(statistics.mean(len(c.tokens) for c in cands))
            t0 = time.perf_counter()
            outs, freply = await tc.forward(verify=verify)
            rows["fwd_wall"].append((time.perf_counter() - t0) * 1e3)
            rows["fwd_service"].append(freply.total_ms)
            rows["fwd_pass"].append(freply.forward_ms)
            for r, o in zip(rids, outs):
                committed[r] = committed[r] + o.tokens
                unsent[r] = o.tokens
                rows["accepted"].append(o.num_accepted)
        # Draft offload -> reload, and the first call after it (every request rebuilds its KV).
        transitions = {"offload_s": [], "reload_s": [], "rebuild_catchup_ms": [], "weight_bytes": 0, "kv_bytes": 0}
        for _ in range(3):
            off = await dc.offload()
            rel = await dc.reload()
            step += 1
            items = [SpeculateItem(r, step, unsent[r], len(committed[r]), depth, width) for r in rids]
            unsent = {r: [] for r in rids}
            _, sreply = await dc.speculate(items)
            transitions["offload_s"].append(off.seconds)
            transitions["reload_s"].append(rel.seconds)
            transitions["rebuild_catchup_ms"].append(sreply.catchup_ms)
            transitions["weight_bytes"], transitions["kv_bytes"] = off.weight_bytes, off.kv_bytes
        await tc.release(rids)
        await dc.release(rids)
        # Serialization share: the same messages encoded and decoded in process.
        from specserve.shared.wire.messages import Forward, ForwardReply, SpeculateReply, StepResult, VerifyEntry

        entries, toks = spec_frame
        flat_nodes = torch.tensor([t for c in cands for t in c.tokens], dtype=torch.int32)
        codec = {
            "speculate_request": _codec_ms(Speculate(entries), {"tokens": toks}),
            "speculate_reply": _codec_ms(SpeculateReply([], 0, 0, 0, 0, 0), {
                "tokens": flat_nodes, "parents": flat_nodes, "path_prob": flat_nodes.float()}),
            "forward_request": _codec_ms(
                Forward([], [VerifyEntry(r, 1, 1, len(c.tokens)) for r, c in zip(rids, cands)]),
                {"tree_tokens": flat_nodes, "tree_parents": flat_nodes}),
            "forward_reply": _codec_ms(ForwardReply([StepResult(r, 1, 3, 2) for r in rids], 0, 0, 0, 0),
                                       {"tokens": flat_nodes[: 3 * n]}),
        }
        med = {k: statistics.median(v) for k, v in rows.items()}
        return {"requests": n, "steps": steps, "depth": depth, "width": width,
                "nodes_per_tree": med["nodes"], "mean_accepted": statistics.mean(rows["accepted"]),
                "health_rtt_ms": med["health"],
                "speculate": {"wall_ms": med["spec_wall"], "service_ms": med["spec_service"],
                              "beam_ms": med["spec_beam"],
                              "overhead_ms": statistics.median(w - s for w, s in zip(rows["spec_wall"],
                                                                                      rows["spec_service"]))},
                "forward": {"wall_ms": med["fwd_wall"], "service_ms": med["fwd_service"], "pass_ms": med["fwd_pass"],
                            "overhead_ms": statistics.median(w - s for w, s in zip(rows["fwd_wall"],
                                                                                    rows["fwd_service"]))},
                "codec_ms": codec,
                "transitions": {k: statistics.median(v) if isinstance(v, list) else v for k, v in transitions.items()}}
    finally:
        draft.stop()
        target.stop()


def beam_grid(ns, ds, ws, repeats: int) -> list[dict]:
    from specserve.draft.config import DraftConfig
    from specserve.draft.engine import DraftEngine

    torch.set_num_threads(1)
    cfg = DraftConfig(model=str(ROOT / "models" / "draft"), device="cpu", dtype="float32", host="", port=0,
                      unix_socket=None, kv_blocks=4096, block_size=16, threads=1, max_frame_mb=256)
    engine = DraftEngine(cfg)
    rows = []
    prompts = _prompts(max(ns))
    for n in tqdm(ns, desc="n"):
        rids = [f"n{n}-{i}" for i in range(n)]
        history = {r: list(p) for r, p in zip(rids, prompts)}

        def call(d: int, w: int, new: dict, step: int, rids=rids, history=history):
            entries = [SpeculateEntry(r, step, len(new[r]), len(history[r]), d, w) for r in rids]
            flat = torch.tensor([t for r in rids for t in new[r]], dtype=torch.int32)
            return engine.speculate(Speculate(entries), {"tokens": flat})

        step = 1
        call(0, 1, history, step)  # the prompts, untimed
        for d in ds:
            for w in ws:
                beam, catchup = [], []
                for _ in range(repeats + 1):
                    step += 1
                    new = {r: [7] for r in rids}
                    for r in rids:
                        history[r].append(7)
                    reply, _ = call(d, w, new, step)
                    beam.append(reply.beam_ms)
                    catchup.append(reply.catchup_ms)
                rows.append({"n": n, "d": d, "w": w, "beam_ms": statistics.median(beam[1:]),
                             "catchup_ms": statistics.median(catchup[1:])})
        for r in rids:
            engine.release(r)
    return rows


def render(result: dict, grid: list[dict], meta: dict) -> str:
    t = result
    lines = [
        "## Service step messages: transport overhead and beam speculation",
        "",
        f"Measured by `bench/service_step.py` on {meta['machine']}, torch {meta['torch']}, commit {meta['commit']}, "
        f"{meta['date']}. Bundled demo pair, float32, CPU, one torch thread per service.",
        "",
        f"### (a) One step of {t['requests']} requests with {t['nodes_per_tree']:.0f}-node trees "
        f"(d={t['depth']}, w={t['width']}), median of {t['steps']} steps",
        "",
        "| call | client wall (ms) | inside the service (ms) | model work (ms) | overhead: transport + loop (ms) |",
        "|---|---|---|---|---|",
        f"| Speculate (64 entries in, 64 trees out) | {t['speculate']['wall_ms']:.2f} | "
        f"{t['speculate']['service_ms']:.2f} | beam {t['speculate']['beam_ms']:.2f} | "
        f"{t['speculate']['overhead_ms']:.2f} |",
        f"| Forward (64 trees in, tokens out) | {t['forward']['wall_ms']:.2f} | {t['forward']['service_ms']:.2f}"
        f" | pass {t['forward']['pass_ms']:.2f} | {t['forward']['overhead_ms']:.2f} |",
        f"| Health (empty) | {t['health_rtt_ms']:.2f} | – | – | {t['health_rtt_ms']:.2f} |",
        "",
        "In-process encode + decode of the same frames (the serialization share of the overhead), ms: "
        + ", ".join(f"{k} {v:.3f}" for k, v in t["codec_ms"].items()) + ".",
        f" Mean accepted draft tokens per tree: {t['mean_accepted']:.2f}.",
        "",
        f"Draft offload -> reload (median of 3, {t['transitions']['weight_bytes'] / 1e6:.1f} MB of weights, "
        f"{t['transitions']['kv_bytes'] / 1e6:.1f} MB KV pool): offload {t['transitions']['offload_s'] * 1e3:.2f} ms, "
        f"reload {t['transitions']['reload_s'] * 1e3:.2f} ms; the first Speculate after a reload rebuilds all "
        f"{t['requests']} requests' draft KV from their histories in {t['transitions']['rebuild_catchup_ms']:.1f} ms.",
        "",
        "### (b) Beam speculation time vs (n, d, w), in process",
        "",
        "Each call appends one committed token per request (catch-up pass) and runs the beam search. "
        "Step 1 reuses the catch-up pass's logits, so d steps cost d - 1 batched passes of n x w nodes.",
        "",
        "| n | d | w | beam (ms) | catch-up (ms) | beam per request (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for row in grid:
        lines.append(f"| {row['n']} | {row['d']} | {row['w']} | {row['beam_ms']:.2f} | {row['catchup_ms']:.2f} | "
                     f"{row['beam_ms'] / row['n']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller grid")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the markdown section here as well as to stdout")
    args = parser.parse_args()
    steps = 5 if args.quick else args.steps
    result = asyncio.run(transport(args.requests, steps, depth=5, width=3))
    if args.quick:
        grid = beam_grid([1, 16], [1, 4], [1, 4], 2)
    else:
        grid = beam_grid([1, 8, 32, 64], [1, 2, 4, 8], [1, 2, 4], args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    meta = {"machine": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
            "torch": torch.__version__, "commit": commit.strip(), "date": time.strftime("%Y-%m-%d")}
    text = render(result, grid, meta)
    print(text)
    print(json.dumps({"transport": result, "beam": grid}, indent=1))
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
