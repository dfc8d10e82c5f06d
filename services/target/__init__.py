"""The target service (`specserve target`): batched prefill and tree verification over a paged KV pool.

`TargetEngine` (engine.py) runs the prefill chunks and the draft trees of many requests in one model
pass, accepts each tree's tokens losslessly under the request's sampling parameters, keeps the
accepted path's KV and, when asked, returns the target's features for an EAGLE draft. simulated.py
runs the same engine on a preset's modelled pass; server.py runs the process; config.py holds its
settings.

See docs/architecture.md, "Target service".
"""
