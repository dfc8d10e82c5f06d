"""The target service: batched prefill and tree verification over a paged KV pool.

See docs/architecture.md, "Target service".
"""
