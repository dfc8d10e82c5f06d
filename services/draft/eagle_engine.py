"""The EAGLE draft (`specserve draft --model <an EAGLE head's directory>`): trees from a head that reads
the target's features (services/draft/eagle_head.py, eagle.py).

`EagleDraftEngine` is the DraftEngine (history, checks, assumed tokens, releases) whose Speculate
calls also carry the target's features ("features", from `feature_start` per entry: the gateway
forwards what the target's passes returned). Per request it keeps the features by position; its
head's entries follow as far as both features and tokens reach. A request whose newest committed
token's entry cannot run yet (features missing, or assumed tokens, which have none) gets a root-only
tree. The head's KV is dense per request, outside the block pool (the pool's blocks all read free);
offload and reload have nothing to move.
"""

from __future__ import annotations

import logging

import torch

from specserve.draft.beam import BeamRequest, BeamTree
from specserve.draft.config import DraftConfig
from specserve.draft.eagle import EagleDrafter
from specserve.draft.eagle_head import load_for_target, target_of
from specserve.draft.engine import DraftEngine
from specserve.draft.ngram import NoKV
from specserve.shared.host.service_base import BadCall
from specserve.shared.runtime.model_store import resolve
from specserve.shared.spec.feature_log import FeatureLog
from specserve.shared.wire.messages import ErrorInfo, Offload, Reload, SpeculateEntry, TransitionReply

log = logging.getLogger(__name__)


class EagleDraftEngine(DraftEngine):
    reads_features = True

    def __init__(self, config: DraftConfig):
        self._init_state(config)  # DraftEngine.__init__ would load a token model; this loads the head
        self.target_dir = resolve(target_of(config.model))
        head = load_for_target(config.model, self.target_dir).to(self.device)
        if config.kernels != "torch":
            head.to_cpu_kernels()  # q8_0 linears through the compiled operators, where they run (CPU)
        self.drafter = EagleDrafter(head)
        self.hidden = head.hidden_size
        self.vocab_size = head.embed.num_embeddings
        self.runner = NoKV(config.kv_blocks)  # type: ignore[assignment]
        self.features: dict[str, FeatureLog] = {}

    def _take_payload(self, entries: list[SpeculateEntry], accepted: set[str],
                      tensors: dict[str, torch.Tensor]) -> None:
        counts = [e.num_features for e in entries]
        flat = tensors.get("features")
        if sum(counts) == 0:
            return
        if any(c < 0 for c in counts) or flat is None or flat.dim() != 2 or flat.shape != (sum(counts), self.hidden):
            raise BadCall(f"tensor 'features' must be [{sum(counts)}, {self.hidden}] "
                          f"(got {None if flat is None else list(flat.shape)})")
        for entry, rows in zip(entries, flat.float().split(counts)):
            if entry.rid not in accepted or not len(rows):
                continue
            store = self.features.setdefault(entry.rid, FeatureLog())
            if not store.write(entry.feature_start, rows):
                log.warning("%s: features from position %d, but only %d are held; dropped", entry.rid,
                            entry.feature_start, store.known)

    def _fit_to_pool(self, entries: list[SpeculateEntry], depths: dict[str, int],
                     failed: dict[str, ErrorInfo]) -> set[str]:
        return set()  # the head's KV is outside the block pool

    def _catch_up(self, entries: list[SpeculateEntry], depths: dict[str, int], skip: set[str],
                  failed: dict[str, ErrorInfo]) -> tuple[dict[str, torch.Tensor], int]:
        """Run the entries that the new features and tokens complete, in one batched pass; the roots
        whose newest entry ran can be speculated from (an empty tensor stands for their logits)."""
        drafter, items, ready = self.drafter, [], {}
        for entry in entries:
            rid = entry.rid
            tokens = self.requests[rid].tokens
            store = self.features.get(rid)
            avail = min(store.known if store else 0, len(tokens) - 1)  # entry i: feature i, token i + 1
            have = drafter.entries(rid)
            if have > avail:
                drafter.truncate(rid, avail)
                have = avail
            complete = avail == len(tokens) - 1 and avail > 0
            if complete and have == avail and drafter.requests[rid].last is None:
                drafter.truncate(rid, avail - 1)  # the newest entry's prediction is needed again
                have = avail - 1
            if have < avail:
                assert store is not None
                items.append((rid, store.read(have, avail), torch.tensor(tokens[have + 1:avail + 1])))
            if depths[rid] > 0:
                if complete:
                    ready[rid] = torch.empty(0)
                else:
                    depths[rid] = 0
        return ready, 1 if drafter.append(items) else 0

    def _beam_search(self, beams: list[BeamRequest]) -> tuple[dict[str, BeamTree], int]:
        return self.drafter.speculate([(b.rid, b.root, b.depth, b.width) for b in beams])

    def _forget_assumed(self, entries: list[SpeculateEntry]) -> None:
        super()._forget_assumed(entries)
        for entry in entries:
            n = len(self.requests[entry.rid].tokens) - 1
            if self.drafter.entries(entry.rid) > n:
                self.drafter.truncate(entry.rid, n)

    def release(self, rid: str) -> bool:
        self.features.pop(rid, None)
        self.drafter.release(rid)
        return super().release(rid)

    def offload(self, _msg: Offload | None = None,
                _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        """Nothing moves: the head is small and stays where it is."""
        return self._transition(0.0, 0, 0), None

    def reload(self, _msg: Reload | None = None,
               _tensors: dict[str, torch.Tensor] | None = None) -> tuple[TransitionReply, None]:
        return self._transition(0.0, 0, 0), None
