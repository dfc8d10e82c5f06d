"""Simulated model services: the target's and the draft's model passes replaced by a latency model
(latency.py) and an acceptance model (acceptance.py, text.py), configured by a preset (preset.py).

`specserve target --simulate SPEC` and `specserve draft --simulate SPEC` are otherwise the same
services: the same protocol, checks and KV block accounting (runner.py keeps the real block
manager); only the pass itself is modelled, and the service sleeps for its modelled time.
See docs/simulation.md.
"""
