"""DraftConfig: everything `specserve draft` can be told, from flags or SPECSERVE_DRAFT_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.shared.host.service_base import ServiceConfig
from specserve.shared.process.ports import DRAFT_PORT
from specserve.shared.process.settings import option, override_default
from specserve.shared.runtime.model_store import MODELS


@dataclass(slots=True, kw_only=True)
class DraftConfig(ServiceConfig):
    """The common service fields, plus the draft's own. Each field is a flag (`--max-depth`) and a
    variable (`SPECSERVE_DRAFT_MAX_DEPTH`); see specserve.shared.process.settings."""

    env_prefix = "SPECSERVE_DRAFT_"

    model: str = override_default(ServiceConfig, "model", default_factory=lambda: str(MODELS / "draft"),
                                  default_text="models/draft, the bundled demo draft")
    port: int = override_default(ServiceConfig, "port", DRAFT_PORT)
    prefill_chunk: int = option(512, "most committed tokens of one request appended per pass")
    max_batch_tokens: int = option(4096, "most tokens in one catch-up pass")
    max_depth: int = option(16, "largest beam depth d accepted")
    max_width: int = option(16, "largest beam width w accepted")
    cuda_graphs: bool = option(True, "run the beam steps eagerly on CUDA too, without CUDA graphs", negate=True)
