"""Speculative decoding's pure parts: sampling parameters and distributions, token trees, lossless
tree acceptance, and the per-request feature log an EAGLE draft reads.

Imports only torch and the standard library: nothing else of specserve.
"""
