"""Code used by more than one specserve service: the model runtime, KV cache, tree verification."""
