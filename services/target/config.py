"""TargetConfig: everything `specserve target` can be told, from flags or SPECSERVE_TARGET_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specserve.shared.service_base import MODELS, add_common_flags

DEFAULT_PORT = 8102


@dataclass(slots=True)
class TargetConfig:
    model: str  # Hugging Face model directory of the target
    device: str  # "cpu" or "cuda[:N]"
    dtype: str  # "float32", "bfloat16" or "float16"
    host: str
    port: int  # TCP port; 0 picks a free one (printed on the ready line)
    unix_socket: str | None  # listen on this path instead of TCP
    kv_blocks: int  # KV pool size, blocks
    block_size: int  # tokens per KV block
    threads: int  # torch intra-op threads
    max_frame_mb: int  # largest accepted message, MiB

    @property
    def address(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        add_common_flags(parser, "target", DEFAULT_PORT, MODELS / "target", kv_blocks=4096)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TargetConfig:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})
