"""The draft and target services as real processes on localhost, driven over the socket transport.

Lossless: prefill -> speculate -> verify every candidate node -> commit, over many steps with mixed
prompt lengths and shapes, equals target-only greedy decoding token for token; so does a run with
the draft offloaded and reloaded in the middle. Robustness: malformed frames, unknown ids, a
request larger than the KV pool and a client that vanishes mid-call leave everyone else served
and no KV block held.

Here: the tests that start no process and open no socket; the others are in tests/service/test_services.py.
"""

from __future__ import annotations

import struct

from specserve.shared.wire.transport import PREFIX


def test_prefix_is_sixteen_bytes():
    assert PREFIX.size == 16 and struct.calcsize("!4sIQ") == 16
