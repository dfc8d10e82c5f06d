"""A streaming client that reads 1 byte/s among fast streams: the fast streams' TPOT beside it, and when
it is cut. SIMULATED model services.

    .venv/bin/python bench/slow_client.py [--preset llama2-7b-a100] [--streams 64] [--runs 3]
        [--max-tokens 256] [--out bench/results/slow_client.json]

One stack (simulated target and draft, docs/simulation.md; the gateway on its defaults: the default
policy, --stream-buffer-bytes 64 KiB, --stream-stall-s 30). Each run, in turn:
- `alone`: --streams fast streams at once (chat tier, short prompts, --max-tokens tokens, EOS
  ignored; the load generator, services/cli/loadgen), nothing else;
- `beside_slow`: one slow client first (a raw socket with a 1 KiB receive buffer: a streaming
  completion of 3,000 tokens, EOS ignored, of which it reads one byte per second), then the same
  fast streams; then the gateway's client_too_slow count is read every 0.5 s until the slow client
  is cut (10 minutes at most).
Reported: per condition the median over runs of the fast streams' median TPOT (min-max), their
ratio within each run, and the seconds from the slow client's request to its cut.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from specserve.gateway.sched.policy import DEFAULT_POLICY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import ROOT, Stack, bench_point, measure_profile, spread, warm_up  # noqa: E402

SLOW_TOKENS = 3000


class SlowReader(threading.Thread):
    """One streaming request whose client reads a byte a second until told to stop or the connection ends."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a small window
        self.sock.connect((host, int(port)))
        self.got = b""
        self.stop = threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": "target", "prompt": "def main():", "max_tokens": SLOW_TOKENS,
                           "ignore_eos": True, "stream": True, "service_tier": "chat"}).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            while not self.stop.wait(1.0) and (byte := self.sock.recv(1)):
                self.got += byte
        except OSError:
            pass  # reset
        self.sock.close()


def cuts(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r'request_errors_total\{[^}]*code="client_too_slow"[^}]*\} (\S+)', text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama2-7b-a100")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "slow_client.json"))
    args = ap.parse_args()
    os.environ.setdefault("SPECSERVE_TARGET_KV_BLOCKS", str(args.streams * 40 + 400))
    os.environ.setdefault("SPECSERVE_DRAFT_KV_BLOCKS", str(args.streams * 40 + 400))
    tmp = Path(tempfile.mkdtemp(prefix="slow-client-"))
    profile = tmp / "profile.json"
    measure_profile(profile, 1, quick=True, simulate=args.preset)
    gateway_args = ["--max-running", str(args.streams + 1)]
    runs = []

    def fast(stack: Stack, label: str) -> dict:
        return bench_point(stack.url, tmp / f"{label}.jsonl", label, num_requests=args.streams,
                           max_concurrency=args.streams, max_tokens=args.max_tokens, mix="chat=1.0:short")

    with Stack(DEFAULT_POLICY, profile, 1, gateway_args, args.preset) as stack:
        warm_up(stack.url, tmp / "warm.jsonl")
        for i in range(args.runs):
            alone = fast(stack, "alone")
            before, slow, t0 = cuts(stack.url), SlowReader(stack.url), time.perf_counter()
            slow.start()
            beside = fast(stack, "beside")
            while cuts(stack.url) == before and time.perf_counter() - t0 < 600:
                time.sleep(0.5)
            cut_after = time.perf_counter() - t0 if cuts(stack.url) > before else None
            slow.stop.set()
            slow.join()
            run = {"alone_tpot_p50_ms": alone["tpot_p50_ms"], "beside_tpot_p50_ms": beside["tpot_p50_ms"],
                   "errors": alone["errors"] + beside["errors"], "slow_cut_after_s": cut_after,
                   "slow_bytes_read": len(slow.got)}
            runs.append(run)
            print(f"run {i + 1}: fast TPOT p50 {run['alone_tpot_p50_ms']:.2f} ms alone, "
                  f"{run['beside_tpot_p50_ms']:.2f} ms beside the slow client; the slow one cut after "
                  f"{cut_after} s; errors {run['errors']}", file=sys.stderr, flush=True)

    def med(key: str) -> dict:
        return spread([r[key] for r in runs])

    ratio = [r["beside_tpot_p50_ms"] / r["alone_tpot_p50_ms"] for r in runs]
    result = {"label": f"simulated, preset {args.preset}", "preset": args.preset, "streams": args.streams,
              "max_tokens": args.max_tokens, "policy": DEFAULT_POLICY, "gateway_args": gateway_args,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs,
              "summary": {"alone_tpot_p50_ms": med("alone_tpot_p50_ms"),
                          "beside_tpot_p50_ms": med("beside_tpot_p50_ms"),
                          "beside_over_alone": spread(ratio),
                          "slow_cut_after_s": med("slow_cut_after_s")}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
