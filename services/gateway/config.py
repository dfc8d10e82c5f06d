"""GatewayConfig: everything `specserve gateway` can be told, from flags or SPECSERVE_GATEWAY_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from specserve.gateway.sched.policy import DEFAULT_POLICY, option_classes, policy_help
from specserve.gateway.sched.routing import ROUTERS
from specserve.shared.process.ports import DRAFT_PORT, GATEWAY_PORT, TARGET_PORT
from specserve.shared.process.settings import Settings, option
from specserve.shared.runtime.model_store import MODELS


@dataclass(slots=True, kw_only=True)
class GatewayConfig(Settings):
    """Each field is a flag (`max_running` -> `--max-running`) and an environment variable
    (`SPECSERVE_GATEWAY_MAX_RUNNING`); its default is declared here only. A new setting is one
    line: `name: int = option(DEFAULT, "help")` (see specserve.shared.process.settings)."""

    env_prefix = "SPECSERVE_GATEWAY_"

    draft: str = option(f"127.0.0.1:{DRAFT_PORT}", "draft service address (host:port or unix:/path)")
    target: list[str] = option(default_factory=lambda: [f"127.0.0.1:{TARGET_PORT}"],
                               help="a target replica's address (host:port or unix:/path); repeat it for N "
                                    "replicas (env: comma-separated)")
    discover_targets: bool = option(False, "each --target host:port is a DNS name: one replica per address it "
                                    "resolves to, re-resolved every --discovery-interval-s; new addresses join, "
                                    "vanished ones are drained and dropped (docker compose --scale, a Kubernetes "
                                    "headless Service)")
    discovery_interval_s: float = option(5.0, "seconds between lookups of the target names (--discover-targets)")
    hosts_file: str | None = option(None, "a hosts file (/etc/hosts format) read before DNS, at every lookup, for "
                                    "the draft's and the targets' names (a name on several lines: all of them)")
    router: str = option("round-robin", "how new requests are spread over the target replicas",
                         choices=tuple(ROUTERS))
    model: str = option(default_factory=lambda: str(MODELS / "target"),
                        help="the target's model directory (tokenizer, chat template, context length)",
                        default_text="models/target, the bundled demo target")
    generation_config: str = option("auto", "where a request's left-out temperature, top_p, top_k, "
                                    "repetition_penalty and min_p come from: auto: the model directory's "
                                    "generation_config.json (else its model.gguf's general.sampling.* metadata); "
                                    "vllm: nowhere (OpenAI's defaults); or another directory holding a "
                                    "generation_config.json (vLLM's flag)")
    served_model_name: str | None = option(None, "model id clients send as \"model\"",
                                           default_text="the model directory's name")
    host: str = option("127.0.0.1", "HTTP host")
    port: int = option(GATEWAY_PORT, "HTTP port (0: any free; the ready line names it)")
    device: str = option("cpu", "the services' device (names the profile file)")
    policy: str = option(DEFAULT_POLICY, f"the speculation policy: {policy_help()}")
    profile: str | None = option(None, "profile file from `specserve profile` (budget B, baseline latency; "
                                 "measured on first start if missing)",
                                 default_text="~/.cache/specserve/profile-<model>-<device>-<target fingerprint>.json: "
                                 "one per target whose passes differ")
    budget: int | None = option(None, "override the profiled budget B, tokens per target pass",
                                default_text="the profile's")
    max_running: int = option(64, "most requests bound to one target replica at once")
    max_prefill_tokens: int = option(256, "most prompt tokens in one replica's pass (chunked prefill)")
    admission: str = option("slo", "slo: SLOs-Serve's planner admits only what can meet its TTFT and TPOT SLOs "
                            "(declined: the next replica with --router slo, then best effort for a request that "
                            "allows it or asks for no SLO, else 503 with Retry-After); fifo: admit in arrival order "
                            "while KV and max_running allow",
                            choices=("fifo", "slo"))
    kv_lookahead_tokens: int = option(0, "0: a request reserves KV for prompt + max_tokens when admitted; N > 0: "
                                      "for its context + N output tokens, grown by N as it goes; when its replica is "
                                      "short, lower-priority requests (best effort, then the newest) are preempted and "
                                      "later resumed by recompute")
    tree_slack_tokens: int = option(64, "KV a request reserves beyond its prompt and output, tokens: room for "
                                    "the tree nodes verified beside its committed tokens")
    max_waiting: int = option(256, "most requests waiting for admission; more get 503 with Retry-After")
    client_timeout_s: float = option(10.0, "a client must send its request head, and then its body, within this "
                                     "many seconds (408 for a body, the connection closed for a head)")
    stream_buffer_bytes: int = option(65536, "bytes a stream's connection may hold unsent, in the socket's send "
                                      "buffer and in the gateway's each; while they are full, the tokens that "
                                      "wait coalesce into one event")
    stream_stall_s: float = option(30.0, "a streaming client that takes none of its waiting bytes for this many "
                                   "seconds is cut: its request ends (error code client_too_slow in "
                                   "specserve:request_errors_total) and the connection is closed")
    call_timeout_s: float = option(30.0, "deadline of every draft and target call, seconds; a service that misses "
                                   "it is marked down and reconnected")
    draft_window_ms: float = option(0.0, "with several target replicas, a draft call waits up to this many ms "
                                    "for the other replicas with requests to queue their entries, so that one "
                                    "call drafts for all of them (0: only those ready in the same turn of the "
                                    "event loop, or while the previous call runs)")
    draft_sync: str = option("lazy", "lazy: requests that do not speculate send their committed tokens to the "
                             "draft with their next speculation; eager: every iteration, beside the target pass",
                             choices=("lazy", "eager"))
    overlap: bool = option(False, "draft each request's next tree beside the target pass, guessing its answer "
                           "(drafting ahead; lossless)")
    overlap_miss: str = option("root", "with --overlap, a request whose guess was wrong verifies next: its root "
                               "alone (root) or a tree drafted before the pass, as without --overlap (draft)",
                               choices=("root", "draft"))
    async_scheduling: str = option("auto", "plan and send a replica's next pass while its current one runs (one "
                                   "step ahead): a decoding request's next root is the token the pass in flight "
                                   "returns, filled in by the target, and a chain is drafted on a guess of that "
                                   "pass's answer (verified where the guess came true, else its root alone); "
                                   "only for passes of root-only or chain decode steps and prompt chunks (no side "
                                   "branches, grammar or preemption; not with --overlap, eager "
                                   "draft sync, --kv-lookahead-tokens or tracing); lossless. auto: on for a "
                                   "replica whose pass runs on a GPU (the host's cores are free while it runs; on "
                                   "a CPU the gateway's work beside the pass takes a core from it)",
                                   choices=("auto", "on", "off"))
    forced_tokens: int = option(16, "structured output: up to this many tokens the request's grammar forces (a "
                                "single allowed token, or a string that must come next) go into its tree each pass, "
                                "verified with it, at most the budget B per pass over all its requests (0: none)")
    slo_classes: list[str] = option(default_factory=list, flag="--slo-class",
                                    help="add or override an SLO class: NAME=TPOT_MS[:TTFT_MS]")
    threads: int = option(1, "torch threads of a target started to profile")
    frontends: int = option(0, "0: this process serves HTTP beside the engine; N > 0: N front-end processes serve "
                            "it on the same port (parsing, tokenizing, detokenizing, streaming) and this process "
                            "runs the engine, joined by msgspec messages over a Unix socket")
    frontend_link: str | None = option(None, "also accept front ends run on their own (`specserve gateway "
                                       "--frontend-of HOST:PORT`, e.g. a Deployment of their own) on this "
                                       "host:port; each proves the shared secret")
    frontend_of: str | None = option(None, "run as a front end of the engine process at this link: unix:/path "
                                     "(set by the engine process for --frontends) or host:port (its "
                                     "--frontend-link); it waits for the engine at start, and exits when the "
                                     "engine goes away")

    @classmethod
    def add_all_flags(cls, parser: argparse.ArgumentParser) -> None:
        """The gateway's flags, then every registered policy's options (policy/__init__.py)."""
        cls.add_flags(parser)
        for options in option_classes():
            options.add_flags(parser.add_argument_group(f"{options.__name__} ({options.__doc__})"))

    def __post_init__(self) -> None:
        if not self.served_model_name:  # after __init__ it is always a name
            self.served_model_name = os.path.basename(os.path.normpath(self.model))
