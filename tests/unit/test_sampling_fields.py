"""The sampling fields a vLLM user sends, on the gateway's side: parsing limits (400s naming the field),
normalization with the model's generation defaults, the request's n generations and their seeds, the
target's parameters built from them, where the output is cut at stop ids, and the defaults read from a
model directory (generation_config.json, a GGUF's metadata)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest

from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.loop import Engine
from specserve.gateway.engine.request import Finished, GenRequest, Tokens
from specserve.gateway.frontend.local import LocalEngine
from specserve.gateway.http.api import ModelInfo, build_request, choice_submissions
from specserve.gateway.http.parse import parse_chat, parse_completion
from specserve.gateway.http.protocol import ApiError, sampling_of
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.routing import RoundRobin
from specserve.gateway.sched.scheduler import Scheduler
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.runtime.generation_defaults import generation_defaults
from specserve.shared.runtime.model_config import ModelLoadError
from specserve.shared.runtime.quant import GGUF_FILE
from specserve.target.state import params_of
from tests.support.engine import Steered

ROOT = Path(__file__).resolve().parents[2]
CHAT = SloClass("chat", 100.0, 5000.0)
EOS = frozenset({0, 4})


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "Hello", **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


def refused(parse, body: bytes, param: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    return info.value


# ---- parsing ---------------------------------------------------------------------------------------
def test_the_fields_are_normalized():
    s = sampling_of(parse_completion(completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                                                min_p=0.1, min_tokens=3, stop_token_ids=[7, 9, 7], n=4, best_of=4)))
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -1.0, 1.2, 0.1)
    assert (s.min_tokens, s.stop_token_ids, s.n) == (3, (7, 9), 4)
    plain = sampling_of(parse_chat(chat(presence_penalty=None, min_p=None, stop_token_ids=None)))
    assert (plain.presence_penalty, plain.min_p, plain.repetition_penalty, plain.min_tokens, plain.n) == (0, 0, 1, 0, 1)


@pytest.mark.parametrize(("field", "value"), [("min_p", "x"), ("min_p", True), ("min_tokens", 1.5), ("n", "2"),
                                              ("stop_token_ids", 2), ("stop_token_ids", ["a"]), ("best_of", 1.5),
                                              ("presence_penalty", "high"), ("repetition_penalty", [1])])
def test_a_wrong_type_names_the_field(field, value):
    param = f"{field}[0]" if field == "stop_token_ids" and isinstance(value, list) else field  # the element
    refused(parse_completion, completion(**{field: value}), param)
    refused(parse_chat, chat(**{field: value}), param)


def test_best_of_must_equal_n():
    parse_completion(completion(n=3, best_of=3))
    parse_chat(chat(n=2, best_of=2))
    err = refused(parse_completion, completion(n=2, best_of=3), "best_of")
    assert "only best_of = n is supported" in err.message
    refused(parse_completion, completion(best_of=2), "best_of")  # n = 1
    refused(parse_chat, chat(n=4, best_of=1), "best_of")


def test_min_tokens_is_at_most_max_tokens():
    parse_completion(completion(min_tokens=16))  # the completion's default max_tokens is 16
    refused(parse_completion, completion(min_tokens=17), "min_tokens")
    refused(parse_chat, chat(max_tokens=5, min_tokens=6), "min_tokens")
    parse_chat(chat(max_tokens=5, max_completion_tokens=9, min_tokens=9))  # max_completion_tokens wins
    assert "max_tokens (5)" in refused(parse_chat, chat(max_completion_tokens=5, min_tokens=6), "min_tokens").message
    parse_chat(chat(min_tokens=1000))  # chat without a max: checked against the context when it is known


def test_the_models_defaults_fill_what_a_request_leaves_out():
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05}
    s = sampling_of(parse_chat(chat(top_p=None)), model)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.min_p) == (0.6, 0.9, 20, 1.1, 0.05)
    own = sampling_of(parse_chat(chat(temperature=0, top_p=1, top_k=-1, repetition_penalty=1, min_p=0)), model)
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty, own.min_p) == (0, 1, 0, 1, 0)
    assert sampling_of(parse_chat(chat()), {"top_k": -1}).top_k == 0  # a model's "off" is off


# ---- the submissions ---------------------------------------------------------------------------------
@pytest.fixture()
def engine() -> LocalEngine:
    replicas = [TargetReplica(0, "unix:/a", PassCost(16, 10.0))]
    policy = Steered()
    core = Engine(policy, Scheduler(policy, RoundRobin()), ServicePool(replicas, None), GatewayMetrics("t"),
                  GatewayConfig())
    return LocalEngine(core, {"chat": CHAT}, Path("profile.json"))


INFO = ModelInfo("m", 64, 100, EOS)


def test_the_target_gets_the_penalties_and_min_tokens_holds_eos_and_the_stop_ids(engine):
    s = sampling_of(parse_completion(completion(temperature=0.5, seed=-1, min_tokens=2, stop_token_ids=[9, 4],
                                                presence_penalty=1, repetition_penalty=1.3, min_p=0.2)))
    sub = build_request(INFO, engine, [5, 6, 7], s, CHAT, "cmpl")
    spec = sub.sampling
    assert (spec.seed, spec.presence_penalty, spec.repetition_penalty, spec.min_p) == (2**63 - 1, 1.0, 1.3, 0.2)
    assert (spec.min_tokens, spec.stop_token_ids, spec.eos_ids, spec.num_prompt) == (2, [9, 4], [0, 4], 3)
    assert sub.stop_ids == EOS
    assert params_of(spec).stop_ids == (9, 4, 0) and params_of(spec).penalized
    plain = build_request(INFO, engine, [5], sampling_of(parse_completion(completion(ignore_eos=True, min_tokens=2))),
                          CHAT, "cmpl")
    assert plain.stop_ids == frozenset() and plain.sampling.eos_ids == [] and not params_of(plain.sampling).penalized


def test_limits_known_only_with_the_model_are_400s(engine):
    with pytest.raises(ApiError) as info:
        build_request(INFO, engine, [5], sampling_of(parse_completion(completion(stop_token_ids=[3, 100]))), CHAT, "c")
    assert info.value.param == "stop_token_ids" and "100" in info.value.message
    with pytest.raises(ApiError) as info:  # chat's max_tokens is the context left: 64 - 4 prompt tokens
        build_request(INFO, engine, [5, 6, 7, 8], sampling_of(parse_chat(chat(min_tokens=61))), CHAT, "c")
    assert info.value.param == "min_tokens"
    build_request(INFO, engine, [5, 6, 7, 8], sampling_of(parse_chat(chat(min_tokens=60))), CHAT, "c")


def test_choice_i_has_its_own_id_and_seed_plus_i(engine):
    sub = build_request(INFO, engine, [5], sampling_of(parse_completion(completion(seed=2**63 - 2, n=3))), CHAT, "c")
    subs = choice_submissions(sub, 3)
    assert [s.rid for s in subs] == [f"{sub.rid}-{i}" for i in range(3)]
    assert [s.sampling.seed for s in subs] == [2**63 - 2, 2**63 - 1, 0]  # seed + i, modulo 2**63 as the seed is
    assert all(s.prompt == sub.prompt and s.sampling.temperature == 1.0 for s in subs)
    unseeded = build_request(INFO, engine, [5], sampling_of(parse_completion(completion(n=2))), CHAT, "c")
    assert [s.sampling.seed for s in choice_submissions(unseeded, 2)] == [None, None]
    assert choice_submissions(sub, 1) == [sub]


# ---- where the output ends -----------------------------------------------------------------------------
def emitted(engine: LocalEngine, tokens: list[int], **fields) -> tuple[list[int], str | None]:
    """The output and finish reason after one step that returns `tokens`."""
    sub = build_request(INFO, engine, [5, 6], sampling_of(parse_completion(completion(max_tokens=8, **fields))),
                        CHAT, "c")
    r = GenRequest.of(sub)
    core = engine.engine
    core.table.queue(r)
    core.passes.commit.emit(r, tokens, 0.0)
    events = []
    while not r.events.empty():
        events.append(r.events.get_nowait())
    assert [t for e in events if isinstance(e, Tokens) for t in e.tokens] == r.output
    return r.output, next((e.reason for e in events if isinstance(e, Finished)), None)


def test_eos_ends_the_output_unseen_and_a_stop_token_id_ends_it_kept(engine):
    assert emitted(engine, [7, 4, 8]) == ([7], "stop")
    assert emitted(engine, [7, 9, 8], stop_token_ids=[9]) == ([7, 9], "stop")
    assert emitted(engine, [7, 9, 8], stop_token_ids=[9, 7], min_tokens=1) == ([7, 9], "stop")
    assert emitted(engine, [7, 0, 9, 8], stop_token_ids=[9], min_tokens=3) == ([7, 0, 9, 8], None)
    assert emitted(engine, [7, 0, 9, 4], stop_token_ids=[9], min_tokens=3) == ([7, 0, 9], "stop")
    assert emitted(engine, [7, 4, 8], ignore_eos=True) == ([7, 4, 8], None)


def test_a_final_only_request_gets_its_tokens_once_with_its_end(engine):
    """A response not streamed (no stop string, no logprobs) wakes its handler once: the engine holds its tokens
    and hands them over as one event just before its Finished, whichever way it ends."""
    for tokens, reason in (([7, 8], "length"), ([7, 4], "stop")):
        sub = build_request(INFO, engine, [5, 6], sampling_of(parse_completion(completion(max_tokens=3))), CHAT, "c")
        r = GenRequest.of(dataclasses.replace(sub, final_only=True))
        core = engine.engine
        core.table.queue(r)
        core.passes.commit.emit(r, [3], 0.0)
        assert r.events.empty() and r.output == [3]
        core.passes.commit.emit(r, tokens, 0.0)  # ends it: max_tokens 3, or EOS (4) unseen
        events = [r.events.get_nowait() for _ in range(r.events.qsize())]
        assert [type(e) for e in events] == [Tokens, Finished] and events[1].reason == reason
        assert events[0].tokens == r.output == [3, *tokens[: 2 if reason == "length" else 1]]
    aborted = GenRequest.of(dataclasses.replace(sub, final_only=True))
    engine.engine.table.queue(aborted)
    engine.engine.table.finish(aborted, "abort")  # nothing emitted: its Finished alone
    assert [type(aborted.events.get_nowait())] == [Finished] and aborted.events.empty()


# ---- the model's defaults ------------------------------------------------------------------------------
def write_gguf(path: Path, **values: float) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        name = f"general.sampling.{key}"
        writer.add_int32(name, value) if isinstance(value, int) else writer.add_float32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_generation_config_then_the_gguf_metadata(tmp_path):
    assert generation_defaults(ROOT / "models" / "target") == {}  # the demo's holds EOS ids only
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "do_sample": False,
                                                                 "top_p": None, "eos_token_id": 2}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20}
    write_gguf(tmp_path / GGUF_FILE, temp=0.25, top_p=0.5, top_k=7, min_p=0.125, penalty_repeat=1.5)
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.5, "min_p": 0.125,
                                             "repetition_penalty": 1.5}


@pytest.mark.parametrize(("config", "key"), [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 2.5}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": "0.1"}, "min_p")])
def test_a_bad_default_stops_the_gateway_naming_it(tmp_path, config, key):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=key):
        generation_defaults(tmp_path)


def test_a_bad_gguf_default_is_named_too(tmp_path):
    write_gguf(tmp_path / GGUF_FILE, min_p=1.5)
    with pytest.raises(ModelLoadError, match=f"{GGUF_FILE}: min_p"):
        generation_defaults(tmp_path)
