"""The draft service (`specserve draft`): the speculation trees the gateway sends to the target.

`DraftEngine` (engine.py) keeps every request's committed tokens, catches the draft model's paged KV
up to them in batched chunks and grows each request's tree by batched beam search (beam.py; on CUDA
the later beam steps replay as graphs at bucketed shapes, static_step.py). It offloads its weights
and KV pool to free device memory and reloads them, rebuilding each request's KV from its history.
The other drafts are that engine with another tree source: the n-gram draft (ngram.py: trees from
the request's own tokens, no model), the replay draft (replay.py: a benchmark's recorded outputs at a
set acceptance), the EAGLE draft (eagle_engine.py: a head over the target's
features, eagle_head.py and eagle.py) and the simulated draft (simulated.py: a preset's acceptance
model). server.py runs the process; config.py holds its settings.

See docs/architecture.md, "Draft service".
"""
