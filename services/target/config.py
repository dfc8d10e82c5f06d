"""TargetConfig: everything `specserve target` can be told, from flags or SPECSERVE_TARGET_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.shared.host.service_base import ServiceConfig
from specserve.shared.process.ports import TARGET_PORT
from specserve.shared.process.settings import option, override_default
from specserve.shared.runtime.model_store import MODELS


@dataclass(slots=True, kw_only=True)
class TargetConfig(ServiceConfig):
    """The common service fields (model, device, dtype, address, KV pool, threads, frame limit).
    Each field is a flag (`--kv-blocks`) and a variable (`SPECSERVE_TARGET_KV_BLOCKS`); see
    specserve.shared.process.settings."""

    env_prefix = "SPECSERVE_TARGET_"

    model: str = override_default(ServiceConfig, "model", default_factory=lambda: str(MODELS / "target"),
                                  default_text="models/target, the bundled demo target")
    port: int = override_default(ServiceConfig, "port", TARGET_PORT)
    cuda_graphs: bool = option(True, "run the passes eagerly on CUDA too, without CUDA graphs (they are captured "
                               "for the torch pass with Triton attention, at bucketed shapes)", negate=True)
