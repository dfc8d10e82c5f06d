"""The checks of one Speculate entry against what the draft holds for its request."""

from __future__ import annotations

from specserve.draft.config import DraftConfig
from specserve.shared.wire.messages import ErrorInfo, SpeculateEntry


def check_entry(entry: SpeculateEntry, toks: list[int], duplicate: bool, have: int | None, last_step: int,
                config: DraftConfig, vocab_size: int) -> ErrorInfo | None:
    """The error the entry gets, or None. `toks`: the tokens the call adds for it; `duplicate`: its id
    came earlier in the same call; `have`: the committed tokens the draft holds for it (None: an unknown
    request), up to its `last_step`."""
    if duplicate:
        return ErrorInfo("duplicate_request", f"{entry.rid!r} appears twice in one call")
    held = have or 0
    if have is not None and entry.step <= last_step:
        return ErrorInfo("stale_step", f"step {entry.step} of {entry.rid!r} is not after {last_step}")
    if not 0 <= entry.num_assumed <= len(toks):
        return ErrorInfo("bad_shape", f"{entry.rid!r}: {entry.num_assumed} assumed tokens, but the call adds "
                         f"{len(toks)}")
    if held + len(toks) - entry.num_assumed != entry.num_committed:
        return ErrorInfo("out_of_sync" if have is not None else "unknown_request",
                         f"{entry.rid!r}: the draft holds {held} committed tokens, the call adds "
                         f"{len(toks) - entry.num_assumed}, but says the request has {entry.num_committed}")
    if held + len(toks) == 0:
        return ErrorInfo("empty_request", f"{entry.rid!r} has no committed tokens to speculate from")
    if not 0 <= entry.depth <= config.max_depth or not 1 <= entry.width <= config.max_width:
        return ErrorInfo("bad_shape", f"depth {entry.depth} / width {entry.width} outside "
                         f"0..{config.max_depth} / 1..{config.max_width}")
    if any(not 0 <= t < vocab_size for t in toks):
        return ErrorInfo("bad_token", f"{entry.rid!r}: token ids outside 0..{vocab_size - 1}")
    return None
