"""A process has all its threads once its parts are made: none appear at a first request.

bench/soak.py holds every process to its idle thread count after each fault; a pool that starts a
thread on first use (the gateway's tokenizer worker at the first long prompt, the Rust tokenizer's
batch pool at the first tokenization, a model service's model thread at its first call) made that
count depend on what the process had served. Here the parts are made, then used for the first time,
and the threads of this process are counted before and after (a thread another part of the test run
ends meanwhile can only lower the count).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "models" / "target")


def test_tokenizing_starts_its_threads_when_made(tokenizer):
    from specserve.gateway.http.tokenize import INLINE_CHARS, Tokenizing

    tok = Tokenizing(tokenizer, 2048)
    before = threads()
    long = "word " * (INLINE_CHARS // 5 + 1)

    async def first_use() -> None:
        await tok.encode("Hello there")
        await tok.encode(long)
        await tok.chat([{"role": "user", "content": long}])

    try:
        asyncio.run(first_use())
        assert threads() <= before, "tokenizing started a thread at its first use"
    finally:
        tok.close()


def test_a_service_host_starts_its_model_thread_when_made():
    import threading

    from specserve.shared.host.service_base import ServiceHost
    from specserve.shared.wire.messages import Health

    host = ServiceHost("target", "m", "cpu", "float32", {}, lambda: Health())
    try:
        assert any(t.name.startswith("target-model") for t in threading.enumerate())
    finally:
        host.executor.shutdown(wait=True)
