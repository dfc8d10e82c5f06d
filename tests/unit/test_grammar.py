"""Structured output's parts in process: bitmask rows, a request's trees shaped by a hand-built grammar
(forced tokens grafted, forbidden nodes pruned, every node's mask), greedy decoding under masks that gives
the same tokens whatever the tree, the request fields into a grammar spec (400s naming the field), and
compiling against the demo tokenizer (xgrammar's reasons, the cache)."""

from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr

from specserve.gateway.engine.constrain import Constraint, graft, single_token
from specserve.gateway.engine.grammar import GrammarError, Grammars, GrammarSpec
from specserve.gateway.http.guided import grammar_spec
from specserve.gateway.http.parse import parse_chat, parse_completion
from specserve.gateway.http.protocol import ApiError
from specserve.gateway.sched.policy.base import CandidateTree
from specserve.shared.spec import token_mask
from specserve.shared.spec.sampling import SamplingParams
from specserve.shared.spec.tree_acceptance import accept_tree
from tests.support.gateway import TARGET

# A hand-built vocabulary and grammar: "{", then "ab" or "ac", then "}"; the stop token ends it.
VOCAB = ["<eos>", "{", "}", "a", "b", "ab", "c", '"', "x"]
EOS, OPEN, CLOSE, A, B, AB, C, QUOTE, X = range(len(VOCAB))
GRAMMAR = 'root ::= "{" body "}"\nbody ::= "ab" | "ac"'


def encode(text: str) -> list[int]:
    """Greedy longest match over VOCAB (the forced strings' tokenizer)."""
    out, at = [], 0
    while at < len(text):
        token = max((t for t, s in enumerate(VOCAB) if t != EOS and text.startswith(s, at)),
                    key=lambda t: len(VOCAB[t]))
        out.append(token)
        at += len(VOCAB[token])
    return out


@pytest.fixture(scope="module")
def compiled() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(GRAMMAR)


def constraint(compiled: xgr.CompiledGrammar, *accepted: int) -> Constraint:
    c = Constraint(compiled, len(VOCAB), encode)
    for t in accepted:
        assert c.accept(t)
    return c


def allowed(rows: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row).flatten().tolist()) for row in token_mask.unpack(rows, len(VOCAB))]


# ---- bitmask rows ---------------------------------------------------------------------------------
def test_rows_pack_and_unpack_as_xgrammar_lays_them_out():
    gen = torch.Generator().manual_seed(3)
    for vocab in (1, 31, 32, 33, 100, 4096):
        bools = torch.rand(5, vocab, generator=gen) < 0.3
        packed = token_mask.pack(bools)
        assert packed.dtype == torch.int32 and packed.shape == (5, token_mask.words_for(vocab))
        assert torch.equal(token_mask.unpack(packed, vocab), bools)
        assert torch.equal(xgr.testing.bitmask_to_bool_mask(packed, vocab), bools)
        assert torch.equal(token_mask.unpack(xgr.testing.bool_mask_to_bitmask(bools), vocab), bools)  # (pads with 1s)


def test_apply_masks_what_a_row_forbids_and_leaves_an_empty_row_alone():
    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rows = token_mask.pack(torch.tensor([[True, False, True, False], [False] * 4, [False, False, False, True]]))
    out = token_mask.apply(logits, rows)
    assert out[0].tolist() == [0, float("-inf"), 2, float("-inf")]
    assert torch.equal(out[1], logits[1])  # a node after the grammar's end: nothing to mask
    assert out[2].argmax() == 3 and torch.isinf(out[2, :3]).all()
    assert torch.equal(logits, torch.arange(12, dtype=torch.float32).reshape(3, 4))  # a new tensor


def test_single_token():
    assert single_token(token_mask.pack(torch.tensor([[False] * 40 + [True]]))[0].numpy()) == 40
    assert single_token(token_mask.pack(torch.tensor([[True] + [False] * 31 + [True]]))[0].numpy()) is None
    assert single_token(token_mask.pack(torch.tensor([[True, True]]))[0].numpy()) is None
    assert single_token(token_mask.pack(torch.tensor([[False, False]]))[0].numpy()) is None


# ---- forced tokens, pruning and masks on the hand-built grammar ---------------------------------------
def test_forced_tokens_single_and_from_the_jump_forward_string(compiled):
    c = constraint(compiled)
    assert c.forced(8) == [OPEN, A]  # "{" is the only token; then "a" must come ("ab" or "ac"), as a string
    assert c.forced(1) == [OPEN]
    assert c.forced(8) == [OPEN, A]  # the matcher is left as it was
    assert constraint(compiled, OPEN, AB, CLOSE).forced(8) == [EOS]  # the stop token, and nothing after it
    assert constraint(compiled, OPEN, A).forced(8) == []  # "b" or "c": the model's choice
    assert c.forced(0) == []


def hand_tree() -> CandidateTree:
    """After "{" (the root): "ab" } <eos> a | x } | a c }."""
    tokens = [OPEN, AB, X, A, CLOSE, CLOSE, C, EOS, A, CLOSE]
    parents = [-1, 0, 0, 0, 1, 2, 3, 4, 7, 6]
    probs = [1.0, 0.5, 0.3, 0.2, 0.4, 0.2, 0.1, 0.3, 0.1, 0.05]
    return CandidateTree(tokens, parents, probs)


def test_shape_grafts_the_forced_chain_prunes_forbidden_nodes_and_masks_every_node(compiled):
    c = constraint(compiled, OPEN)
    tree = c.shape(hand_tree(), 8)
    # "x" (and its subtree) is forbidden after "{"; nothing may follow the stop token
    assert tree.tokens == [OPEN, AB, A, CLOSE, C, EOS, CLOSE]
    assert tree.parents == [-1, 0, 0, 1, 2, 3, 4]
    shaped = c.shaped
    assert shaped is not None and shaped.tree is tree
    assert shaped.forced == [2]  # the forced "a" ran through the draft's own "a" node
    assert tree.path_prob[2] == 1.0 and tree.path_prob[4] == pytest.approx(0.5)  # given the forced "a"
    assert tree.path_prob[6] == pytest.approx(0.25) and tree.path_prob[1] == 0.5
    assert allowed(shaped.masks) == [{A, AB}, {CLOSE}, {B, C}, {EOS}, {CLOSE}, set(), {EOS}]
    assert allowed(shaped.rows([0, 2, 4])) == [{A, AB}, {B, C}, {CLOSE}]
    assert c.take_shaped(tree, OPEN) is shaped and c.shaped is None  # taken once


def test_the_forced_chain_grows_the_tree_where_the_draft_has_no_such_node(compiled):
    c = constraint(compiled)  # nothing accepted yet: "{" is forced, then "a"
    tree = c.shape(CandidateTree([QUOTE, X], [-1, 0], [1.0, 0.9]), 8)
    assert tree.tokens == [QUOTE, OPEN, A] and tree.parents == [-1, 0, 1]  # "x" pruned, the chain added
    assert c.shaped is not None and c.shaped.forced == [1, 2] and tree.path_prob == [1.0, 1.0, 1.0]
    assert allowed(c.shaped.masks) == [{OPEN}, {A, AB}, {B, C}]
    root_alone = c.shape(CandidateTree.root_only(QUOTE), 0)
    assert root_alone.tokens == [QUOTE] and allowed(c.take_shaped(None, QUOTE).masks) == [{OPEN}]


def test_graft_keeps_the_tree_without_a_chain():
    tree = hand_tree()
    assert graft(tree, []) == (tree, [])


def test_a_tree_not_shaped_this_iteration_still_gets_its_masks(compiled):
    c = constraint(compiled, OPEN)
    shaped = c.take_shaped(hand_tree(), OPEN)  # no shape() call: masks alone, nothing pruned
    assert shaped.forced == [] and len(shaped.tree.tokens) == 10
    rows = allowed(shaped.masks)
    assert rows[0] == {A, AB} and rows[2] == set()  # "x": refused, never reached (its parent's row forbids it)


def test_a_dead_end_is_told_from_the_end():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    dead = xgr.GrammarCompiler(info, cache_enabled=False).compile_regex("a[^\\s\\S]")  # nothing may follow "a"
    c = Constraint(dead, len(VOCAB), encode)
    assert not c.dead_end() and c.accept(A) and c.dead_end() and not c.terminated
    assert not c.accept(B) and c.shape(CandidateTree([A, B], [-1, 0], [1.0, 0.5]), 4).tokens == [A]


def test_where_only_the_end_may_follow_the_output_can_go_no_further(compiled):
    """(min_tokens may forbid that end: the target then has no allowed token)"""
    c = constraint(compiled, OPEN, AB, CLOSE)
    assert c.dead_end() and not c.terminated
    assert not constraint(compiled, OPEN, A).dead_end()
    assert c.accept(EOS) and c.terminated and not c.dead_end()


# ---- greedy decoding under masks is the same whatever the tree ------------------------------------
def logits_of(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed pseudo-random model: the logits after a context depend on the context alone."""
    return torch.randn(len(VOCAB), generator=torch.Generator().manual_seed(hash(context) % 2**31))


def decode(compiled: xgr.CompiledGrammar, trees: bool, seed: int, forced: int) -> list[int]:
    """Greedy decoding from "{" under the grammar; trees: random draft trees verified each step."""
    rng = random.Random(seed)
    c, output = constraint(compiled, OPEN), [OPEN]
    while True:
        tokens, parents = [output[-1]], [-1]
        for _ in range(rng.randint(0, 6) if trees else 0):
            tokens.append(rng.randrange(len(VOCAB)))
            parents.append(rng.randrange(len(tokens) - 1))
        tree = c.shape(CandidateTree(tokens, parents, [1.0] * len(tokens)), forced)
        shaped = c.take_shaped(tree, output[-1])
        paths = [[]]  # each node's tokens from the root's child down
        for v in range(1, len(tree.tokens)):
            paths.append(paths[tree.parents[v]] + [tree.tokens[v]])
        logits = torch.stack([logits_of(tuple(output + p)) for p in paths])
        step = accept_tree(tree.tokens, tree.parents, token_mask.apply(logits, shaped.masks), SamplingParams(0.0))
        for t in step.tokens:
            if t == EOS:
                return output
            assert c.accept(t)
            output.append(t)


def test_greedy_output_under_the_grammar_is_the_same_with_any_tree(compiled):
    plain = [decode(compiled, trees=False, seed=0, forced=0) for _ in range(1)][0]
    assert plain[0] == OPEN and plain[-1] == CLOSE and "".join(VOCAB[t] for t in plain) in ("{ab}", "{ac}")
    for seed in range(30):
        assert decode(compiled, trees=True, seed=seed, forced=seed % 3) == plain


# ---- request fields -> a spec ---------------------------------------------------------------------
def chat(**fields) -> bytes:
    import json

    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(("fields", "kind", "source"), [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_object", ""),
    ({"guided_json": SCHEMA}, "json_schema", '{"type":"object","properties":{"b":{"type":"integer"},'
                                            '"a":{"type":"string"}}}'),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", '{"type":"integer"}'),
    ({"guided_regex": r"\d+"}, "regex", r"\d+"),
    ({"guided_choice": ["yes", "n\"o"]}, "choice", '["yes", "n\\"o"]'),
    ({"guided_grammar": "root ::= \"a\""}, "ebnf", "root ::= \"a\""),
    ({"guided_json": None, "response_format": None}, None, None),
])
def test_fields_become_one_spec(fields, kind, source):
    for parse in (parse_chat, parse_completion):
        body = chat(**fields) if parse is parse_chat else chat(**fields).replace(b'"messages"', b'"prompt": "x", "m"')
        spec = grammar_spec(parse(body))
        assert (spec.kind, spec.source) == (kind, source) if kind else spec is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_grammar": {}}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a" * 100_001}, "guided_regex"),
])
def test_malformed_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as info:
        parse_chat(chat(**fields))
    assert info.value.status == 400 and info.value.param == param, info.value


# ---- compiling against the demo tokenizer -----------------------------------------------------------
@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from transformers import AutoTokenizer

    return Grammars(AutoTokenizer.from_pretrained(TARGET), 4096, frozenset({0}))


@pytest.mark.parametrize(("spec", "reason"), [
    (GrammarSpec("regex", "a(", "guided_regex"), "The parenthesis is not closed"),
    (GrammarSpec("ebnf", "root ::= x", "guided_grammar"), 'Rule "x" is not defined'),
    (GrammarSpec("json_schema", '{"type":"foo"}', "guided_json"), 'Unsupported type "foo"'),
    (GrammarSpec("choice", "[]", "guided_choice"), "non-empty list"),
])
def test_what_xgrammar_refuses_is_a_grammar_error_with_its_reason(grammars, spec, reason):
    with pytest.raises(GrammarError) as info:
        grammars.compile(spec)
    assert info.value.field == spec.field and reason in info.value.message
    assert info.value.message.startswith(f"{spec.field}: ") and "/project/" not in info.value.message


def test_compiled_grammars_are_cached_by_spec(grammars):
    import asyncio

    spec = GrammarSpec("choice", '["yes", "no"]', "guided_choice")
    assert grammars.cached(spec) is None
    first = asyncio.run(grammars.compile_async(spec))
    again = grammars.cached(GrammarSpec("choice", '["yes", "no"]', "another field"))  # the field is not the key
    assert again is not None and again.compiled is first.compiled
    c = first.constraint()
    assert all(c.accept(t) for t in grammars.encode("yes")) and c.accept(0) and c.terminated
