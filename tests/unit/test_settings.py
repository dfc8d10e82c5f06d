"""specserve.shared.process.settings: one declaration per setting -> flag, environment variable, default.

The unit tests use a demo dataclass with every supported type; the last tests run the real
console script with a bad SPECSERVE_DRAFT_PORT in the environment.

Here: the tests that start no process and open no socket; the others are in tests/service/test_settings.py.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import pytest

from specserve.shared.process.settings import Settings, SettingsError, add_flags, from_args, option, override_default

built = []  # calls of Demo.stamp's default_factory


def stamp() -> str:
    built.append(1)
    return "computed"


@dataclass(slots=True, kw_only=True)
class Demo(Settings):
    env_prefix = "DEMO_"

    count: int = option(3, "a count")
    ratio: float = option(0.5, "a ratio")
    name: str = option("x", "a name")
    mode: str = option("fast", "a mode", choices=["fast", "slow"])
    verbose: bool = option(False, "talk more")
    graphs: bool = option(True, "no graphs", negate=True)
    limit: int | None = option(None, "a limit", default_text="no limit")
    path: str | None = option(None, "a path")
    scale: float | None = option(None, "a scale")
    tags: list[str] = option(default_factory=list, flag="--tag", help="a tag")
    sizes: list[int] = option(default_factory=lambda: [1, 2], help="sizes")
    stamp: str = option(default_factory=stamp, help="computed default")


def parse(argv: list[str], cls: type = Demo) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cls.add_flags(parser)
    return parser.parse_args(argv)


def make(argv: list[str] = (), env: dict[str, str] | None = None, cls: type = Demo):
    return cls.from_args(parse(list(argv), cls), environ=env or {})


def test_defaults_come_from_the_dataclass():
    assert make() == Demo()
    config = make()
    assert (config.count, config.ratio, config.name, config.mode) == (3, 0.5, "x", "fast")
    assert (config.verbose, config.graphs, config.limit, config.path, config.scale) == (False, True, None, None, None)
    assert (config.tags, config.sizes, config.stamp) == ([], [1, 2], "computed")


def test_flag_beats_environment_beats_default():
    assert make([], {}).count == 3
    assert make([], {"DEMO_COUNT": "5"}).count == 5
    assert make(["--count", "7"], {"DEMO_COUNT": "5"}).count == 7
    # A flag given with the default's value still beats the environment.
    assert make(["--count", "3"], {"DEMO_COUNT": "5"}).count == 3


def test_each_type_from_flags():
    config = make(["--count", "-4", "--ratio", "inf", "--name", "y", "--mode", "slow", "--verbose", "--no-graphs",
                   "--limit", "9", "--path", "/p", "--scale", "1.5", "--tag", "a", "--tag", "b=1:2",
                   "--sizes", "8", "--stamp", "given"])
    assert (config.count, config.name, config.mode, config.verbose, config.graphs) == (-4, "y", "slow", True, False)
    assert math.isinf(config.ratio)
    assert (config.limit, config.path, config.scale) == (9, "/p", 1.5)
    assert (config.tags, config.sizes, config.stamp) == (["a", "b=1:2"], [8], "given")


def test_each_type_from_the_environment():
    env = {"DEMO_COUNT": "12", "DEMO_RATIO": "0.25", "DEMO_NAME": "envname", "DEMO_MODE": "slow",
           "DEMO_VERBOSE": "yes", "DEMO_GRAPHS": "0", "DEMO_LIMIT": "40", "DEMO_PATH": "/tmp/s",
           "DEMO_SCALE": "2", "DEMO_TAGS": "gold=20:500, silver=40,,", "DEMO_SIZES": "3,4", "DEMO_STAMP": "env"}
    config = make([], env)
    assert (config.count, config.ratio, config.name, config.mode) == (12, 0.25, "envname", "slow")
    assert (config.verbose, config.graphs, config.limit, config.path, config.scale) == (True, False, 40, "/tmp/s", 2.0)
    assert (config.tags, config.sizes, config.stamp) == (["gold=20:500", "silver=40"], [3, 4], "env")


def test_optional_values_are_none_when_empty():
    assert make([], {"DEMO_LIMIT": "", "DEMO_PATH": "", "DEMO_SCALE": ""}) == Demo()
    assert make(["--limit", "", "--path", ""], {"DEMO_LIMIT": "5", "DEMO_PATH": "/x"}) == Demo()


@pytest.mark.parametrize(("var", "value", "problem"), [
    ("DEMO_COUNT", "abc", "is not an integer"),
    ("DEMO_COUNT", "1.5", "is not an integer"),
    ("DEMO_LIMIT", "many", "is not an integer"),
    ("DEMO_RATIO", "half", "is not a number"),
    ("DEMO_SCALE", "big", "is not a number"),
    ("DEMO_SIZES", "1,x", "is not an integer"),
    ("DEMO_VERBOSE", "maybe", "is not a boolean (1/0, true/false, yes/no)"),
    ("DEMO_GRAPHS", "", "is not a boolean (1/0, true/false, yes/no)"),
    ("DEMO_MODE", "medium", "is not one of fast, slow"),
])
def test_a_bad_environment_value_names_the_variable_and_the_type(var, value, problem):
    with pytest.raises(SettingsError) as err:
        make([], {var: value})
    assert str(err.value) == f"{var}={value!r} {problem}"


def test_a_bad_environment_value_is_ignored_when_the_flag_is_given():
    assert make(["--count", "2"], {"DEMO_COUNT": "abc"}).count == 2


@pytest.mark.parametrize(("text", "value"), [
    ("1", True), ("true", True), ("True", True), ("YES", True), ("yes", True),
    ("0", False), ("false", False), ("FALSE", False), ("No", False), ("no", False),
])
def test_bools_from_the_environment(text, value):
    assert make([], {"DEMO_VERBOSE": text}).verbose is value
    assert make([], {"DEMO_GRAPHS": text}).graphs is value


@pytest.mark.parametrize("text", ["2", "on", "y", "t", "", "truee"])
def test_other_bool_words_are_refused(text):
    with pytest.raises(SettingsError, match="DEMO_VERBOSE=.* is not a boolean"):
        make([], {"DEMO_VERBOSE": text})


def test_negate_flag():
    parser = argparse.ArgumentParser()
    Demo.add_flags(parser)
    flags = {s for action in parser._actions for s in action.option_strings}
    assert "--no-graphs" in flags and "--graphs" not in flags
    assert "--verbose" in flags and "--no-verbose" not in flags
    assert make().graphs is True
    assert make(["--no-graphs"]).graphs is False
    assert make(["--no-graphs"], {"DEMO_GRAPHS": "1"}).graphs is False  # the flag wins
    assert make([], {"DEMO_GRAPHS": "false"}).graphs is False


def test_repeatable_list_replaces_the_environment_list():
    assert make(["--tag", "a"], {"DEMO_TAGS": "x,y"}).tags == ["a"]
    assert make(["--tag", "a", "--tag", "b"]).tags == ["a", "b"]
    assert make([], {"DEMO_TAGS": "x,y"}).tags == ["x", "y"]
    # Default factories give each config its own list.
    first, second = make(), make()
    first.tags.append("z")
    assert second.tags == []


def test_bad_flag_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--count", "abc"])
    assert exit_.value.code == 2
    assert "argument --count: 'abc' is not an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--mode", "medium"])
    assert "invalid choice: 'medium'" in capsys.readouterr().err


def test_building_and_parsing_never_read_the_environment(monkeypatch):
    for name in ("COUNT", "RATIO", "VERBOSE", "GRAPHS", "TAGS", "SIZES", "MODE"):
        monkeypatch.setenv(f"DEMO_{name}", "not-valid")
    args = parse([])
    assert vars(args) == {}  # a flag not given leaves nothing behind, not even a default
    with pytest.raises(SettingsError, match="DEMO_"):
        Demo.from_args(args)  # environ defaults to os.environ: only now are the variables read


def test_os_environ_is_the_default_source(monkeypatch):
    monkeypatch.setenv("DEMO_COUNT", "21")
    assert Demo.from_args(parse([])).count == 21


def test_help_shows_the_default_and_the_variable():
    built.clear()
    parser = argparse.ArgumentParser()
    Demo.add_flags(parser)
    text = " ".join(parser.format_help().split())
    assert "a count (default: 3; env DEMO_COUNT)" in text
    assert "a limit (default: no limit; env DEMO_LIMIT)" in text
    assert "a ratio (default: 0.5; env DEMO_RATIO)" in text
    assert "computed default (default: computed; env DEMO_STAMP)" in text and built  # the factory, called to show
    assert "--no-graphs no graphs (default: graphs on; env DEMO_GRAPHS=1|0)" in text
    assert "--tag TAG a tag (default: none; env DEMO_TAGS, comma-separated; repeatable)" in text
    assert "sizes (default: 1, 2; env DEMO_SIZES" in text


def test_module_functions_with_an_explicit_prefix():
    @dataclass
    class Small:
        port: int = option(80, "port")

    parser = argparse.ArgumentParser()
    add_flags(parser, Small, "OTHER_")
    assert "env OTHER_PORT" in parser.format_help()
    assert from_args(Small, parser.parse_args([]), "OTHER_", {"OTHER_PORT": "81"}).port == 81
    assert from_args(Small, parser.parse_args([]), None, {"OTHER_PORT": "81"}).port == 80  # no variables


def test_required_settings_and_overridden_defaults():
    @dataclass(kw_only=True)
    class Base(Settings):
        env_prefix = "BASE_"
        port: int = option(help="the port")

    @dataclass(kw_only=True)
    class Child(Base):
        env_prefix = "CHILD_"
        port: int = override_default(Base, "port", 8101)

    with pytest.raises(SettingsError, match=r"--port is required \(or set BASE_PORT\)"):
        make([], {}, cls=Base)
    assert make(["--port", "1"], {}, cls=Base).port == 1
    assert make([], {}, cls=Child).port == 8101
    assert make([], {"CHILD_PORT": "9"}, cls=Child).port == 9
    parser = argparse.ArgumentParser()
    Child.add_flags(parser)
    assert "the port (default: 8101; env CHILD_PORT)" in " ".join(parser.format_help().split())


def test_declaration_mistakes_are_caught_at_add_flags():
    @dataclass
    class NoOption:
        port: int = 1

    @dataclass
    class Unsupported:
        mapping: dict = option(default_factory=dict)

    @dataclass
    class TrueWithoutNegate:
        on: bool = option(True)

    @dataclass
    class NegateWithoutTrue:
        off: bool = option(False, negate=True)

    @dataclass
    class NegateNotBool:
        count: int = option(1, negate=True)

    for cls in (NoOption, Unsupported, TrueWithoutNegate, NegateWithoutTrue, NegateNotBool):
        with pytest.raises(TypeError):
            add_flags(argparse.ArgumentParser(), cls, "X_")


# --- the real configs -------------------------------------------------------------------------


def test_service_configs_keep_their_defaults_and_variables():
    from specserve.cli.main import build_parser
    from specserve.cli.up import UpConfig
    from specserve.draft.config import DraftConfig
    from specserve.gateway.config import GatewayConfig
    from specserve.target.config import TargetConfig

    parser = build_parser()
    draft = DraftConfig.from_args(parser.parse_args(["draft"]), environ={})
    target = TargetConfig.from_args(parser.parse_args(["target"]), environ={})
    assert (draft.port, draft.kv_blocks, draft.cuda_graphs, draft.max_depth) == (8101, 4096, True, 16)
    assert (target.port, target.kv_blocks, target.block_size) == (8102, 4096, 16)
    assert draft.model.endswith("models/draft") and target.model.endswith("models/target")
    assert DraftConfig.from_args(parser.parse_args(["draft", "--no-cuda-graphs"]), environ={}).cuda_graphs is False
    assert DraftConfig.from_args(parser.parse_args(["draft"]),
                                 environ={"SPECSERVE_DRAFT_CUDA_GRAPHS": "0"}).cuda_graphs is False
    assert TargetConfig.from_args(parser.parse_args(["target"]),
                                  environ={"SPECSERVE_DRAFT_PORT": "1"}).port == 8102  # the draft's is not read

    gateway = GatewayConfig.from_args(parser.parse_args(["gateway", "--slo-class", "gold=20:500",
                                                         "--slo-class", "x=5", "--budget", "32"]), environ={})
    assert (gateway.draft, gateway.target, gateway.port, gateway.policy) == ("127.0.0.1:8101", ["127.0.0.1:8102"],
                                                                              8000, "joint")
    two = GatewayConfig.from_args(parser.parse_args(["gateway", "--target", "a:1", "--target", "b:2"]), environ={})
    assert two.target == ["a:1", "b:2"]
    assert GatewayConfig.from_args(parser.parse_args(["gateway"]),
                                   environ={"SPECSERVE_GATEWAY_TARGET": "a:1,b:2"}).target == ["a:1", "b:2"]
    assert (gateway.slo_classes, gateway.budget, gateway.profile) == (["gold=20:500", "x=5"], 32, None)
    assert gateway.served_model_name == "target"  # the model directory's name
    env = {"SPECSERVE_GATEWAY_SERVED_MODEL_NAME": "m", "SPECSERVE_GATEWAY_BUDGET": ""}
    gateway = GatewayConfig.from_args(parser.parse_args(["gateway"]), environ=env)
    assert (gateway.served_model_name, gateway.budget) == ("m", None)

    up = UpConfig.from_args(parser.parse_args(["up", "--no-restart", "--port", "0", "--", "--budget", "32"]),
                            environ={"SPECSERVE_DRAFT_MODEL": "/d", "SPECSERVE_THREADS": "3"})
    assert (up.restart, up.port, up.draft_model, up.threads) == (False, 0, "/d", 3)
    assert up.gateway_args == ["--", "--budget", "32"]
    assert UpConfig.from_args(parser.parse_args(["up"]), environ={}).gateway_args == []
    # up's services on Unix sockets unless TCP is asked for; small model calls inline unless 0
    assert UpConfig.from_args(parser.parse_args(["up"]), environ={}).tcp_services is False
    assert UpConfig.from_args(parser.parse_args(["up"]), environ={"SPECSERVE_TCP_SERVICES": "1"}).tcp_services
    assert UpConfig.from_args(parser.parse_args(["up", "--tcp-services"]), environ={}).tcp_services
    assert (draft.inline_tokens, target.inline_tokens) == (64, 64)
    assert TargetConfig.from_args(parser.parse_args(["target"]),
                                  environ={"SPECSERVE_TARGET_INLINE_TOKENS": "0"}).inline_tokens == 0


def test_a_flag_may_have_aliases():
    @dataclass(slots=True, kw_only=True)
    class Aliased(Settings):
        num_requests: int = option(100, "requests", aliases=("-n",))

    parser = argparse.ArgumentParser()
    Aliased.add_flags(parser)
    assert Aliased.from_args(parser.parse_args(["-n", "7"])).num_requests == 7
    assert Aliased.from_args(parser.parse_args(["--num-requests", "8"])).num_requests == 8
    assert Aliased.from_args(parser.parse_args([])).num_requests == 100
