"""Structured output end to end on the demo pair (`specserve up`, the official openai client): the SDK's
`chat.completions.parse` with a pydantic model parses 20 of 20 answers (sampled); guided_choice answers are
one of the choices (also with n choices, penalties and min_tokens), guided_regex answers match the
regex; greedy output with a schema is the same under the default policy, `chain:4` (also drafting
ahead) and `none`, with forced tokens and without; and under `none` the forced tokens put more than one
token into a target pass (without them: exactly one per pass). The demo target is tiny: its JSON is
nonsense, but valid."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.support.gateway import PROMPTS, aclient, wait_all_free
from tests.support.procs import gateway


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    tags: list[Literal["small", "loud"]] = Field(max_length=2)


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "label": {"type": "string", "maxLength": 6},
                                           "done": {"type": "boolean"}},
          "required": ["id", "label", "done"], "additionalProperties": False}
CHOICES = ["red", "green", "blue", "light green"]
REGEX = r"[A-Z][a-z]{2,6} \d{2}"
X = 92  # "x" in the demo vocabulary
MAX_TOKENS = 120  # room for every schema here to finish


def test_sdk_parse_gives_a_parsed_object_20_of_20(up):
    async def run():
        c = aclient(up.url)
        out = await asyncio.gather(*[c.chat.completions.parse(
            model="target", messages=[{"role": "user", "content": f"Describe pet number {i}: {PROMPTS[i % 6]}"}],
            response_format=Pet, max_tokens=MAX_TOKENS, seed=i) for i in range(20)])
        await c.close()
        return out

    for completion in asyncio.run(run()):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet), choice.message.content
    wait_all_free(up)


def test_guided_choice_and_regex(up):
    async def run():
        c = aclient(up.url)
        chosen = [c.completions.create(model="target", prompt=p, max_tokens=16, temperature=t,
                                       extra_body={"guided_choice": CHOICES}) for p in PROMPTS[:3] for t in (0, 1.2)]
        matched = [c.chat.completions.create(model="target", messages=[{"role": "user", "content": p}], max_tokens=24,
                                             temperature=t, extra_body={"guided_regex": REGEX})
                   for p in PROMPTS[:3] for t in (0, 1.2)]
        out = await asyncio.gather(*chosen), await asyncio.gather(*matched)
        await c.close()
        return out

    chosen, matched = asyncio.run(run())
    assert all(r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop" for r in chosen), chosen
    for r in matched:
        assert re.fullmatch(REGEX, r.choices[0].message.content) and r.choices[0].finish_reason == "stop", r
    wait_all_free(up)


def test_a_grammar_beside_n_choices_penalties_and_min_tokens(up):
    """Each choice has its own grammar state; penalties change the scores the mask leaves; min_tokens cannot
    keep a finished choice open (where only its end may follow, the output ends)."""
    async def run():
        c = aclient(up.url)
        out = await c.completions.create(
            model="target", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=3, n=3, presence_penalty=1.5,
            extra_body={"guided_choice": CHOICES, "repetition_penalty": 1.3, "min_tokens": 8})
        cornered = await c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                              extra_body={"guided_choice": ["x"], "stop_token_ids": [X],
                                                          "min_tokens": 2})
        await c.close()
        return out, cornered

    out, cornered = asyncio.run(run())
    assert len(out.choices) == 3
    assert all(ch.text in CHOICES and ch.finish_reason == "stop" for ch in out.choices), out.choices
    # the grammar allows only "x", which min_tokens forbids (a stop token id): nothing is left to emit
    assert (cornered.choices[0].text, cornered.choices[0].finish_reason) == ("", "stop")
    wait_all_free(up)


async def schema_greedy(url: str) -> list[tuple[str, int, int]]:
    """(text, completion tokens, target passes) of greedy schema answers to three prompts."""
    c = aclient(url)
    out = await asyncio.gather(*[c.completions.create(
        model="target", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
        for p in PROMPTS[:3]])
    await c.close()
    # passes: the prompt's (its first token), then one per verified tree
    return [(r.choices[0].text, r.usage.completion_tokens, 1 + len(r.model_extra["specserve"]["steps"]))
            for r in out]


@pytest.fixture(scope="module")
def default_answers(up):
    return asyncio.run(schema_greedy(up.url))


@pytest.mark.parametrize(("policy", "forced", "more"), [("chain:4", 16, ()), ("none", 16, ()), ("none", 0, ()),
                                                     ("chain:4", 0, ()), ("chain:4", 16, ("--overlap",))])
def test_greedy_schema_output_is_the_same_under_every_policy(up, suite_profile, default_answers, policy, forced, more):
    """The masks decide every position whatever the tree; under `none` only forced tokens share a pass."""
    for text, _, _ in default_answers:
        json.loads(text)
    g = gateway(up, policy, "--budget", "24", "--profile", str(suite_profile), "--forced-tokens", str(forced), *more)
    try:
        answers = asyncio.run(schema_greedy(g.address))
    finally:
        g.stop()
    assert [text for text, _, _ in answers] == [text for text, _, _ in default_answers]
    if policy == "none":
        tokens, passes = sum(n for _, n, _ in answers), sum(p for _, _, p in answers)
        print(f"policy none, --forced-tokens {forced}: {tokens} tokens in {passes} passes "
              f"({tokens / passes:.2f} per pass)")
        # a grammar's stop token is emitted in a pass too, though not counted as a completion token
        assert passes < tokens if forced else passes in (tokens, tokens + len(answers))
    wait_all_free(up)
