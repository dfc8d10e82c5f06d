"""The draft service: batched beam speculation over a paged KV pool.

See docs/architecture.md, "Draft service".
"""
