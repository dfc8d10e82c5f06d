"""GatewayConfig: everything `specserve gateway` can be told, from flags or SPECSERVE_GATEWAY_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from specserve.shared.service_base import MODELS

DEFAULT_PORT = 8000


@dataclass(slots=True)
class GatewayConfig:
    draft: str  # draft service address (host:port or unix:/path)
    target: str  # target service address
    model: str  # the target's model directory: tokenizer, chat template and context length come from it
    served_model_name: str  # the id clients send as "model"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 picks a free port (printed on the ready line)
    device: str = "cpu"  # the services' device (names the profile file)
    policy: str = "adaserve"  # see specserve.gateway.policy.NAMES
    max_depth: int = 8  # D_max, beam depth cap
    max_width: int = 4  # W_max, beam width cap
    max_added: int = 16  # n_max, most nodes the SLO phase adds to one request
    profile: str | None = None  # profile file (budget B, baseline latency); default: per model and device
    budget: int | None = None  # override the profiled budget B, tokens per target pass
    max_running: int = 64  # most requests decoding at once
    max_prefill_tokens: int = 256  # most prompt tokens per iteration (chunked prefill), tokens
    slo_classes: list[str] = field(default_factory=list)  # extra/overriding classes, NAME=TPOT_MS[:TTFT_MS]
    threads: int = 1  # torch threads when the gateway profiles on first start

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        values = {name: getattr(args, name) for name in cls.__dataclass_fields__}
        if not values["served_model_name"]:
            values["served_model_name"] = os.path.basename(os.path.normpath(values["model"]))
        return cls(**values)

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        def env(flag: str, default):
            return os.environ.get(f"SPECSERVE_GATEWAY_{flag.upper()}", default)

        parser.add_argument("--draft", default=env("draft", "127.0.0.1:8101"), help="draft service address")
        parser.add_argument("--target", default=env("target", "127.0.0.1:8102"), help="target service address")
        parser.add_argument("--model", default=env("model", str(MODELS / "target")),
                            help="the target's model directory (tokenizer, chat template, context length)")
        parser.add_argument("--served-model-name", default=env("served_model_name", None),
                            help="model id clients use (default: the model directory's name)")
        parser.add_argument("--host", default=env("host", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(env("port", DEFAULT_PORT)), help="HTTP port (0: any free)")
        parser.add_argument("--device", default=env("device", "cpu"), help="the services' device (names the profile)")
        parser.add_argument("--policy", default=env("policy", "adaserve"),
                            help="adaserve | none | chain:K | tree:W1,W2,... | equal-greedy | global-greedy")
        parser.add_argument("--max-depth", type=int, default=int(env("max_depth", 8)), help="D_max, beam depth cap")
        parser.add_argument("--max-width", type=int, default=int(env("max_width", 4)), help="W_max, beam width cap")
        parser.add_argument("--max-added", type=int, default=int(env("max_added", 16)),
                            help="n_max, most nodes AdaServe's SLO phase adds to one request")
        parser.add_argument("--profile", default=env("profile", None),
                            help="profile file from `specserve profile` (measured on first start if missing)")
        parser.add_argument("--budget", type=int, default=env("budget", None),
                            help="override the profiled budget B (tokens per target pass)")
        parser.add_argument("--max-running", type=int, default=int(env("max_running", 64)))
        parser.add_argument("--max-prefill-tokens", type=int, default=int(env("max_prefill_tokens", 256)),
                            help="most prompt tokens per iteration (chunked prefill)")
        parser.add_argument("--slo-class", dest="slo_classes", action="append", default=[],
                            help="add or override an SLO class: NAME=TPOT_MS[:TTFT_MS] (repeatable)")
        parser.add_argument("--threads", type=int, default=int(env("threads", 1)),
                            help="torch threads of a target started to profile")
