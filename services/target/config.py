"""TargetConfig: everything `specserve target` can be told, from flags or SPECSERVE_TARGET_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specserve.shared.service_base import MODELS, ServiceConfig, add_common_flags

DEFAULT_PORT = 8102


@dataclass(slots=True)
class TargetConfig(ServiceConfig):
    """The common service fields (model, device, dtype, address, KV pool, threads, frame limit)."""

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        add_common_flags(parser, "target", DEFAULT_PORT, MODELS / "target", kv_blocks=4096)
