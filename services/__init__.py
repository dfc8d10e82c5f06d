"""specserve: an LLM server that gives every request its own latency target through speculative decoding."""

__version__ = "0.1.0"
