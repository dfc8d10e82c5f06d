"""The cyclic garbage collector, set for a serving process once it has started."""

from __future__ import annotations

import gc

# Allocations between two young-generation collections (CPython's default: 700). A step over many requests
# allocates tens of thousands of short-lived containers (messages, views, lists per entry); at 700 many are
# caught alive mid-step, promoted, and the older generations then fill and get walked.
YOUNG_THRESHOLD = 50_000


def freeze_startup_objects() -> None:
    """What startup loaded (torch, a model, a tokenizer: some 300,000 objects) lives as long as the process:
    take it out of the collector's generations, or every full collection walks it all again, a pause of tens of
    ms that lands in whichever step allocates (docs/simulation.md, Scale; docs/lab/step_overhead.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
