"""Logprobs, from the target's rows to OpenAI's JSON, without processes.

The target engine runs in-process on the bundled demo target: its logprobs (prompt positions in one
chunk or several, the first token, a verified chain's tokens) equal transformers' log_softmax of the
same positions; requests that did not ask get nothing; a resume token gets no row; bad counts are
refused. Then the pieces after it: the flat payload cut back per result, the engine's prompt rows
kept once per position, the HTTP side's release of rows with their text (stop strings cut them) and
the JSON shapes, which the official `openai` client's types parse.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import openai.types.chat.chat_completion as chat_types
import openai.types.completion_choice as completion_types
import pytest
import torch

from specserve.gateway.engine.commit import keep_prompt_logprobs
from specserve.gateway.engine.request import Finished, GenRequest, Submission, Tokens
from specserve.gateway.http.api import Generation
from specserve.gateway.http.logprobs import (
    LOGPROB_FLOOR,
    LogprobTrack,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
)
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.spec.logprobs import score
from specserve.shared.wire.logprobs import TokenLogprobs, cut
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine
from specserve.target.simulated import simulated_engine

TARGET = Path(__file__).resolve().parents[2] / "models" / "target"
PROMPT = [72, 400, 1201, 33, 9, 870, 15, 3001, 77, 260, 41, 5, 6, 7, 8, 900, 1900, 2900, 12, 13]
TOP = 5
_steps = itertools.count(1)


@pytest.fixture(scope="module")
def target() -> TargetEngine:
    return TargetEngine(TargetConfig(kv_blocks=64, threads=1))


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    """The greedy continuation of PROMPT by 3 tokens, and transformers' log_softmax at every position
    of PROMPT + those tokens [len, V], float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype="float32").eval()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return ids[len(PROMPT):], rows


def forward(engine: TargetEngine, prefill=(), verify=(), tokens=(), tree=((), ())):
    tensors = {"prefill_tokens": torch.tensor(list(tokens), dtype=torch.int32),
               "tree_tokens": torch.tensor(list(tree[0]), dtype=torch.int32),
               "tree_parents": torch.tensor(list(tree[1]), dtype=torch.int32)}
    reply, payload = engine.forward(Forward(list(prefill), list(verify)), tensors)
    assert all(r.error is None for r in reply.results), reply.results
    return reply, payload, cut(payload, reply.results)


def prefill_in(engine: TargetEngine, rid: str, sizes: list[int], spec: SamplingSpec):
    """PROMPT prefilled in chunks of `sizes`; the prompt rows of all chunks, and the last chunk's token and row."""
    rows, start = TokenLogprobs([], [], []), 0
    for n in sizes:
        last = start + n == len(PROMPT)
        _, payload, [(prompt, out)] = forward(engine, [PrefillEntry(rid, next(_steps), start, n, last,
                                                                    spec if start == 0 else None)],
                                              tokens=PROMPT[start:start + n])
        if prompt is not None:
            rows.extend(prompt)
        start += n
    return rows, payload["tokens"].tolist(), out


def close_to(rows: TokenLogprobs, ref: torch.Tensor, tokens: list[int]) -> None:
    """rows equal ref's log_softmax rows (one per token) at `tokens` and at their top TOP, sorted."""
    assert len(rows) == len(tokens) == len(ref)
    assert torch.allclose(torch.tensor(rows.logprobs), ref.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4)
    for ids, values, want in zip(rows.top_ids, rows.top_logprobs, ref):
        assert values == sorted(values, reverse=True) and len(ids) == TOP
        assert torch.allclose(torch.tensor(values), want.topk(TOP).values, atol=1e-4)
        assert torch.allclose(want[ids], torch.tensor(values), atol=1e-4)


@pytest.mark.parametrize("sizes", [[20], [7, 7, 6], [1, 18, 1]])
def test_prompt_and_first_token_logprobs_are_transformers_log_softmax(target, reference, sizes):
    continuation, ref = reference
    rid = f"p{sizes}"
    rows, first, out = prefill_in(target, rid, sizes, SamplingSpec(0.0, logprobs=TOP, prompt_logprobs=True))
    close_to(rows, ref[:len(PROMPT) - 1], PROMPT[1:])
    assert first == continuation[:1]
    close_to(out, ref[len(PROMPT) - 1:len(PROMPT)], first)
    assert target.release(rid)


def test_verified_chain_logprobs_are_the_positions_rows(target, reference):
    """A chain of the two next greedy tokens: all accepted, plus the bonus token; each token's row is the
    verification pass's at the node that emitted it."""
    continuation, ref = reference
    _, first, _ = prefill_in(target, "v", [20], SamplingSpec(0.0, logprobs=TOP))
    chain = [first[0], *continuation[1:3]]
    reply, payload, [(prompt, out)] = forward(target, verify=[VerifyEntry("v", next(_steps), len(PROMPT) + 1, 3)],
                                              tree=(chain, [-1, 0, 1]))
    emitted = payload["tokens"].tolist()
    assert prompt is None and emitted[:2] == continuation[1:3] and reply.results[0].num_logprobs == 3
    assert emitted[2] == int(ref[len(PROMPT) + 2].argmax())
    close_to(out, ref[len(PROMPT):len(PROMPT) + 3], emitted)
    assert target.release("v")


def test_requests_that_did_not_ask_get_nothing_and_bad_counts_are_refused(target):
    _, payload, [(prompt, out)] = forward(target, [PrefillEntry("n", next(_steps), 0, 20, True, SamplingSpec(0.0))],
                                          tokens=PROMPT)
    assert prompt is None and out is None and set(payload) == {"tokens"}
    assert target.release("n")
    for spec in (SamplingSpec(logprobs=21), SamplingSpec(logprobs=-1), SamplingSpec(prompt_logprobs=True)):
        reply, _ = target.forward(Forward([PrefillEntry("bad", next(_steps), 0, 20, True, spec)]),
                                  {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)})
        assert reply.results[0].error is not None and reply.results[0].error.code == "bad_sampling"
    assert "bad" not in target.requests


def test_a_resume_token_gets_no_row(target):
    spec = SamplingSpec(0.0, logprobs=2)
    reply, _, [(prompt, out)] = forward(target, [PrefillEntry("r", next(_steps), 0, 20, True, spec, resume_token=9)],
                                        tokens=PROMPT)
    assert (prompt, out, reply.results[0].num_logprobs) == (None, None, 0)
    assert target.release("r")


def test_the_simulated_target_gives_certain_logprobs():
    """`--simulate`: the true token at every position, so every logprob is 0 and the one ranked token is it."""
    s = score(torch.tensor([5, 7]), [5, 7], 3)
    assert s.logprobs.tolist() == [0.0, 0.0] and s.top_ids.tolist() == [[5], [7]]
    sim = simulated_engine(TargetConfig(simulate="cpu-demo", kv_blocks=64))
    spec = SamplingSpec(0.0, logprobs=3, prompt_logprobs=True)
    for start, n in ((0, 12), (12, 8)):
        _, payload, [(prompt, out)] = forward(sim, [PrefillEntry("s", next(_steps), start, n, start + n == 20,
                                                                 spec if start == 0 else None)],
                                              tokens=PROMPT[start:start + n])
        assert prompt.logprobs == [0.0] * (n - (start == 0)) and prompt.top_ids == [[t] for t in PROMPT[start:][:n]][
            (start == 0):]
    first = payload["tokens"].tolist()
    assert out.logprobs == [0.0] and out.top_ids == [first]
    _, payload, [(_, out)] = forward(sim, verify=[VerifyEntry("s", next(_steps), 21, 1)], tree=(first, [-1]))
    assert out.logprobs == [0.0] and out.top_ids == [payload["tokens"].tolist()]
    assert sim.release("s")


def test_prompt_rows_are_kept_once_per_position():
    """A prompt chunk prefilled again (a preemption before the first token) adds no position twice."""
    r = GenRequest("x", list(range(10)), SamplingSpec(logprobs=0, prompt_logprobs=True), 4,
                   SloClass("chat", 100.0, 1000.0), frozenset())

    def rows(first: int, last: int) -> TokenLogprobs:  # positions first..last, each logprob = -position
        return TokenLogprobs([-float(p) for p in range(first, last + 1)], [[]] * (last - first + 1),
                             [[]] * (last - first + 1))

    keep_prompt_logprobs(r, 0, rows(1, 3))  # chunk 0..3: positions 1..3
    keep_prompt_logprobs(r, 0, rows(1, 5))  # prefilled again from 0 after a preemption: 0..5
    keep_prompt_logprobs(r, 6, rows(6, 9))
    assert r.prompt_logprobs is not None and r.prompt_logprobs.logprobs == [-float(p) for p in range(1, 10)]


# ---- the HTTP side --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET))


@pytest.fixture(scope="module")
def strings(tokenizer) -> TokenStrings:
    return TokenStrings(tokenizer)


def test_token_bytes_are_the_tokens_own(tokenizer, strings):
    ids = tokenizer.encode("a世b")
    assert len(ids) == 5  # 'a', three byte tokens of 世, 'b'
    assert b"".join(bytes(strings.bytes(t)) for t in ids) == "a世b".encode()
    assert strings.text(ids[0]) == "a" and strings.bytes(tokenizer.encode(" the")[0]) == list(b" the")


class Events:
    """The engine side of a Generation in a test: its events are the ones the test puts on the queue, and
    an abort's Finished."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.aborted: list[str] = []

    def submit(self, sub: Submission) -> asyncio.Queue:
        return self.queue

    def abort(self, rid: str, reason: str = "abort") -> None:  # as the engine does: the request ends
        self.aborted.append(reason)
        self.queue.put_nowait(Finished(reason, report={}))


def generate(tokenizer, strings, token_events: list[list[int]], stops=(), echo_prompt: list[int] | None = None):
    """A Generation fed these Tokens events (row i of token t: logprob -t / 1000, top [(t, ...)]) and a
    Finished: its text pieces, each with the entries released with it."""
    def rows(tokens: list[int]) -> TokenLogprobs:
        return TokenLogprobs([-t / 1000 for t in tokens], [[t] for t in tokens], [[-t / 1000] for t in tokens])

    async def run():
        engine = Events()
        prompt = echo_prompt or tokenizer.encode("Say:")
        sub = Submission("g", prompt, SamplingSpec(logprobs=1), 64, SloClass("chat", 1e3, 1e4), frozenset())
        echo = tokenizer.decode(prompt) if echo_prompt else None
        gen = Generation(engine, sub, tokenizer, stops, echo, strings)
        for i, toks in enumerate(token_events):
            prompt_rows = rows(prompt[1:]) if echo_prompt and i == 0 else None
            engine.queue.put_nowait(Tokens(toks, rows(toks), prompt_rows))
        engine.queue.put_nowait(Finished("length"))
        out = []
        async for piece in gen.pieces():
            out.append((piece, gen.logprobs.take()))
        return out

    return asyncio.run(run())


def test_entries_go_out_with_their_text_and_stop_where_a_stop_string_cuts_it(tokenizer, strings):
    ids = tokenizer.encode("one two three four")
    pieces = generate(tokenizer, strings, [ids[:2], ids[2:]])
    assert "".join(p for p, _ in pieces) == "one two three four"
    entries = [e for _, es in pieces for e in es]
    assert [e.token for e in entries] == ids and [e.logprob for e in entries] == [-t / 1000 for t in ids]
    assert [strings.text(t) for t in ids] == ["one", " two", " th", "ree", " f", "our"]
    assert [e.offset for e in entries] == [0, 3, 7, 10, 13, 15]
    # " th" holds the start of the stop string "hre": its text starts before the cut, so it goes; "ree" does not
    pieces = generate(tokenizer, strings, [ids], stops=("hre",))
    assert "".join(p for p, _ in pieces) == "one two t"
    assert [e.token for _, es in pieces for e in es] == ids[:3]
    # a stop string at a token's first character: that token's text was not returned
    pieces = generate(tokenizer, strings, [ids[:3], ids[3:]], stops=(" three",))
    assert "".join(p for p, _ in pieces) == "one two"
    assert [e.token for _, es in pieces for e in es] == ids[:2]


def test_a_characters_bytes_go_with_the_character(tokenizer, strings):
    """The byte tokens of one character start where it does; a stop string at it drops them all."""
    ids = tokenizer.encode("a世b")
    track = LogprobTrack()
    track.receive(Tokens(ids, None))
    for token, made in zip(ids, [1, 0, 0, 1, 1]):
        track.fed(token, made, made, False)
        if token == ids[1]:
            assert [e.token for e in track.take()] == ids[:1]  # its character is not out yet
    assert [e.offset for e in track.take()] == [1, 1, 1, 2]
    pieces = generate(tokenizer, strings, [ids], stops=("世",))
    assert "".join(p for p, _ in pieces) == "a" and [e.token for _, es in pieces for e in es] == ids[:1]


def test_echo_entries_come_first_with_a_null_first_logprob(tokenizer, strings):
    prompt = tokenizer.encode("Hello world")
    out = tokenizer.encode(" again")
    pieces = generate(tokenizer, strings, [out], echo_prompt=prompt)
    text = "".join(p for p, _ in pieces)
    entries = [e for _, es in pieces for e in es]
    assert text == "Hello world again" and [e.token for e in entries] == prompt + out
    assert entries[0].logprob is None and entries[0].top is None and entries[1].logprob == -prompt[1] / 1000
    assert [text[e.offset:e.offset + len(strings.text(e.token))] for e in entries] == \
        [strings.text(t) for t in prompt + out]


def test_json_shapes_parse_as_openai_types(tokenizer, strings):
    ids = tokenizer.encode("one two")
    pieces = generate(tokenizer, strings, [ids], echo_prompt=tokenizer.encode("Hi"))
    entries = [e for _, es in pieces for e in es]
    entries[-1].logprob = float("-inf")
    body = completion_logprobs(entries, strings)
    assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None  # the echoed prompt's first
    parsed = completion_types.Logprobs.model_validate({k: v[1:] for k, v in body.items()})  # (typed float, not null)
    assert parsed.token_logprobs[-1] == LOGPROB_FLOOR and parsed.tokens[-1] == " two"
    assert all(strings.text(e.token) in top for e, top in zip(entries[1:], parsed.top_logprobs))
    chat = chat_types.ChoiceLogprobs.model_validate(chat_logprobs(entries[1:], strings))
    assert [c.token for c in chat.content] == [strings.text(e.token) for e in entries[1:]]
    assert chat.content[0].top_logprobs[0].bytes == strings.bytes(entries[1].token)


def test_track_without_rows_for_a_token_floors_it():
    track = LogprobTrack()
    track.receive(Tokens([1, 2], TokenLogprobs([-0.5], [[1]], [[-0.5]])))
    track.fed(1, 1, 1, False)
    track.fed(2, 1, 1, False)
    assert [(e.logprob, e.offset) for e in track.take()] == [(-0.5, 0), (LOGPROB_FLOOR, 1)]
