"""`specserve up`: target, draft and gateway as three processes, health-checked, stopped together.

The draft and target get fixed free ports, so that a service that crashes is restarted on the same
address and the gateway reconnects to it. Ctrl-C (SIGINT to the process group) or SIGTERM stops
all three: the gateway first, then the draft and the target.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import urllib.request

from specserve.launch import ServiceProcess, free_port
from specserve.shared.service_base import MODELS, default_threads

RESTART_AFTER_S = 2.0  # wait this long before restarting a crashed draft or target


def add_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--host", default=env("SPECSERVE_HOST", "127.0.0.1"), help="the gateway's HTTP host")
    parser.add_argument("--port", type=int, default=int(env("SPECSERVE_PORT", 8000)), help="HTTP port (0: any free)")
    parser.add_argument("--policy", default=env("SPECSERVE_POLICY", "adaserve"),
                        help="adaserve | none | chain:K | tree:W1,W2,... | equal-greedy | global-greedy")
    parser.add_argument("--model", default=env("SPECSERVE_MODEL", str(MODELS / "target")),
                        help="target model directory (default: the bundled demo target)")
    parser.add_argument("--draft-model", default=env("SPECSERVE_DRAFT_MODEL", str(MODELS / "draft")),
                        help="draft model directory (default: the bundled demo draft)")
    parser.add_argument("--device", default=env("SPECSERVE_DEVICE", "cpu"), help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=env("SPECSERVE_DTYPE", "float32"),
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=int(env("SPECSERVE_THREADS", default_threads())),
                        help="torch threads of each model service")
    parser.add_argument("--profile", default=env("SPECSERVE_PROFILE", None),
                        help="profile file (measured on first start if missing)")
    parser.add_argument("--log-level", default=env("SPECSERVE_LOG_LEVEL", "WARNING"))
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="do not restart a draft or target service that exits")
    parser.add_argument("gateway_args", nargs=argparse.REMAINDER,
                        help="after --: more gateway flags (e.g. -- --budget 32 --slo-class gold=20)")


def main(args: argparse.Namespace) -> int:
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    common = ["--device", args.device, "--dtype", args.dtype]
    specs = {
        "target": ["--model", args.model, *common, "--port", str(free_port())],
        "draft": ["--model", args.draft_model, *common, "--port", str(free_port())],
    }
    procs: dict[str, ServiceProcess] = {}

    def start(kind: str) -> ServiceProcess:
        print(f"starting {kind} ...", file=sys.stderr, flush=True)
        proc = ServiceProcess(kind, *specs[kind], threads=args.threads, log_level=args.log_level,
                              inherit_stderr=True)
        print(f"ready {kind} {proc.address}", flush=True)
        return proc

    try:
        for kind in ("target", "draft"):
            procs[kind] = start(kind)
        extra = [a for a in args.gateway_args if a != "--"]
        specs["gateway"] = ["--draft", procs["draft"].address, "--target", procs["target"].address,
                            "--model", args.model, "--device", args.device, "--policy", args.policy,
                            "--host", args.host, "--port", str(args.port),
                            *(["--profile", args.profile] if args.profile else []), *extra]
        procs["gateway"] = start("gateway")
        url = procs["gateway"].address
        _wait_healthy(url)
        print(f"specserve is up: {url}/v1 (policy {args.policy}; Ctrl-C stops all three)", flush=True)
        while not stopping.wait(0.5):
            for kind in ("target", "draft"):
                if not procs[kind].alive() and args.restart:
                    print(f"the {kind} service exited ({procs[kind].proc.returncode}); restarting it",
                          file=sys.stderr, flush=True)
                    time.sleep(RESTART_AFTER_S)
                    procs[kind] = start(kind)
            if not procs["gateway"].alive():
                print(f"the gateway exited ({procs['gateway'].proc.returncode}); stopping", file=sys.stderr)
                return 1
        return 0
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for kind in ("gateway", "draft", "target"):
            if kind in procs:
                procs[kind].stop()
        print("specserve stopped", file=sys.stderr, flush=True)


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} did not become healthy in {timeout_s:.0f} s")
        time.sleep(0.2)
