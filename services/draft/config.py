"""DraftConfig: everything `specserve draft` can be told, from flags or SPECSERVE_DRAFT_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from specserve.shared.service_base import MODELS, add_common_flags

DEFAULT_PORT = 8101


@dataclass(slots=True)
class DraftConfig:
    model: str  # Hugging Face model directory of the draft
    device: str  # "cpu" or "cuda[:N]"
    dtype: str  # "float32", "bfloat16" or "float16"
    host: str
    port: int  # TCP port; 0 picks a free one (printed on the ready line)
    unix_socket: str | None  # listen on this path instead of TCP
    kv_blocks: int  # KV pool size, blocks
    block_size: int  # tokens per KV block
    threads: int  # torch intra-op threads
    max_frame_mb: int  # largest accepted message, MiB
    prefill_chunk: int = 512  # most committed tokens of one request appended per pass, tokens
    max_batch_tokens: int = 4096  # most tokens in one catch-up pass, tokens
    max_depth: int = 16  # largest beam depth d accepted
    max_width: int = 16  # largest beam width w accepted
    cuda_graphs: bool = True  # capture the beam steps as CUDA graphs (CUDA only)

    @property
    def address(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"

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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DraftConfig:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})
