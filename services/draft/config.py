"""DraftConfig: everything `specserve draft` can be told, from flags or SPECSERVE_DRAFT_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from specserve.shared.service_base import MODELS, ServiceConfig, add_common_flags

DEFAULT_PORT = 8101


@dataclass(slots=True)
class DraftConfig(ServiceConfig):
    """The common service fields, plus the draft's own."""

    prefill_chunk: int = 512  # most committed tokens of one request appended per pass, tokens
    max_batch_tokens: int = 4096  # most tokens in one catch-up pass, tokens
    max_depth: int = 16  # largest beam depth d accepted
    max_width: int = 16  # largest beam width w accepted
    cuda_graphs: bool = True  # capture the beam steps as CUDA graphs (CUDA only)

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        add_common_flags(parser, "draft", DEFAULT_PORT, MODELS / "draft", kv_blocks=4096)
        env = os.environ.get
        parser.add_argument("--prefill-chunk", type=int, default=int(env("SPECSERVE_DRAFT_PREFILL_CHUNK", 512)),
                            help="most tokens of one request appended per pass")
        parser.add_argument("--max-batch-tokens", type=int, default=int(env("SPECSERVE_DRAFT_MAX_BATCH_TOKENS", 4096)),
                            help="most tokens per catch-up pass")
        parser.add_argument("--max-depth", type=int, default=16)
        parser.add_argument("--max-width", type=int, default=16)
        parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                            default=env("SPECSERVE_DRAFT_CUDA_GRAPHS", "1") != "0",
                            help="run the beam steps eagerly on CUDA too")
