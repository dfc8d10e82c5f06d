"""Config dataclasses whose fields are also their command-line flags and environment variables.

Every setting is declared once, as a dataclass field; its default lives only there. From that one
declaration come the argparse flag (`--flag-name`, from the field name with `_` -> `-`), its help
text (showing the default and the environment variable) and the environment variable
(`<env_prefix><FIELD_NAME>`, e.g. `SPECSERVE_DRAFT_PORT`)::

    from dataclasses import dataclass
    from typing import ClassVar

    from specserve.shared.process.settings import Settings, option

    @dataclass(slots=True, kw_only=True)
    class GatewayConfig(Settings):
        env_prefix: ClassVar[str] = "SPECSERVE_GATEWAY_"

        port: int = option(8000, "HTTP port (0: any free)")
        budget: int | None = option(None, "override the profiled budget B")
        slo_classes: list[str] = option(default_factory=list, help="NAME=TPOT_MS", flag="--slo-class")

    GatewayConfig.add_flags(parser)                     # one flag per field
    config = GatewayConfig.from_args(parser.parse_args())

A value comes from, first to last: the command line, the environment variable, the field's
default (or `default_factory()`). The parser itself never reads the environment (its defaults are
`argparse.SUPPRESS`, so a flag that was not given leaves no attribute behind): a bad variable of
one subcommand cannot break another subcommand's parser. `from_args` reads and converts the
variables, and a bad one raises `SettingsError` naming it, e.g.
`SPECSERVE_DRAFT_PORT='abc' is not an integer`; the `specserve` CLI prints that as `error: ...`
and exits 2.

Field types (resolved with `typing.get_type_hints`) and how a value is written:

| annotation | flag | environment variable |
|---|---|---|
| `int`, `float`, `str` | `--name VALUE` | the value (`float` takes `inf`) |
| `int \\| None`, `float \\| None`, `str \\| None` | `--name VALUE`; `--name ''` is None | the value; empty is None |
| `bool`, default False | `--name` sets True | `1/0`, `true/false`, `yes/no` (any case) |
| `bool`, default True, `negate=True` | `--no-name` sets False | as above |
| `list[str]` (`int`, `float` items too) | repeatable: `--name A --name B` | comma-separated, `A,B` |
| any, `remainder=True` | positional `argparse.REMAINDER` | none |

A command-line list replaces the environment's list; it does not extend it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self

__all__ = ["FlagDoc", "Option", "Settings", "SettingsError", "add_flags", "flag_doc", "from_args", "option",
           "override_default", "values"]

METADATA_KEY = "specserve.settings"
_MISSING: Any = dataclasses.MISSING
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


class SettingsError(ValueError):
    """A setting that cannot be used: a bad environment value, or a required one that is missing.

    The message is one line naming the variable and what is wrong with it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """What a field says about its flag, beyond its type and default (kept in the field's metadata)."""

    help: str = ""
    flag: str | None = None  # the flag's name, e.g. "--slo-class" (default: "--" + name with "-")
    choices: tuple | None = None  # allowed values (checked for flags and environment values alike)
    negate: bool = False  # a bool defaulting to True: the flag is "--no-<name>" and sets False
    remainder: bool = False  # a list[str] that takes everything left on the command line (no env)
    metavar: str | None = None
    default_text: str | None = None  # how help shows the default, where the value itself says little
    aliases: tuple[str, ...] = ()  # more flag names, e.g. ("-n",)


def option(default: Any = _MISSING, help: str = "", *, default_factory: Callable[[], Any] = _MISSING,
           flag: str | None = None, choices: Sequence | None = None, negate: bool = False,
           remainder: bool = False, metavar: str | None = None, default_text: str | None = None,
           aliases: Sequence[str] = ()) -> Any:
    """A dataclass field that is also a flag and an environment variable.

    `default` (or `default_factory`, for lists and computed values such as a path or the core
    count) is the setting's only default; the flag's help shows it (a factory is called to show
    it). With neither, the setting is required. `default_text` replaces the shown default where
    the value says little (`None` -> "the model directory's name")."""
    meta = Option(help, flag, tuple(choices) if choices is not None else None, negate, remainder, metavar,
                  default_text, tuple(aliases))
    return dataclasses.field(default=default, default_factory=default_factory, metadata={METADATA_KEY: meta})


def override_default(base: type, name: str, default: Any = _MISSING, *,
                     default_factory: Callable[[], Any] = _MISSING, default_text: str | None = None) -> Any:
    """Redeclare `base`'s field `name` in a subclass with its own default, keeping help and flag
    (and `default_text`, unless a new one is given).

    `port: int = override_default(ServiceConfig, "port", 8101)`."""
    inherited = {f.name: f for f in dataclasses.fields(base)}[name]
    metadata: Mapping[str, Any] = inherited.metadata
    if default_text is not None:
        metadata = {**metadata, METADATA_KEY: dataclasses.replace(metadata[METADATA_KEY], default_text=default_text)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    """One field, resolved: how to parse it and where its value comes from."""

    name: str
    kind: type  # int, float, str or bool; for a list, its items' type
    optional: bool  # `X | None`
    is_list: bool
    option: Option
    field: dataclasses.Field

    @property
    def flag(self) -> str:
        if self.option.flag:
            return self.option.flag
        return ("--no-" if self.option.negate else "--") + self.name.replace("_", "-")

    def env_var(self, env_prefix: str | None) -> str | None:
        if env_prefix is None or self.option.remainder:
            return None
        return f"{env_prefix}{self.name.upper()}"

    def has_default(self) -> bool:
        return self.field.default is not _MISSING or self.field.default_factory is not _MISSING

    def default(self) -> Any:
        factory = self.field.default_factory
        if callable(factory):
            return factory()
        return self.field.default


@functools.cache
def _specs(cls: type) -> tuple[_Spec, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        opt = f.metadata.get(METADATA_KEY)
        if opt is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with settings.option()")
        kind, optional, is_list = _resolve(cls, f.name, hints[f.name])
        if opt.remainder and not (is_list and kind is str):
            raise TypeError(f"{cls.__name__}.{f.name}: remainder=True needs list[str]")
        if kind is bool:
            if optional or is_list:
                raise TypeError(f"{cls.__name__}.{f.name}: bool | None and list[bool] are not supported")
            default = f.default
            if opt.negate and default is not True:
                raise TypeError(f"{cls.__name__}.{f.name}: negate=True needs the default True")
            if not opt.negate and default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a bool flag defaults to False (or True with negate=True)")
        elif opt.negate:
            raise TypeError(f"{cls.__name__}.{f.name}: negate=True is for bool fields")
        specs.append(_Spec(f.name, kind, optional, is_list, opt, f))
    return tuple(specs)


def _resolve(cls: type, name: str, tp: Any) -> tuple[type, bool, bool]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2 and rest[0] in (int, float, str):
            return rest[0], True, False
    elif origin is list and len(args) == 1 and args[0] in (int, float, str):
        return args[0], False, True
    elif tp in (int, float, str, bool):
        return tp, False, False
    raise TypeError(f"{cls.__name__}.{name}: unsupported type {tp!r} (int, float, str, bool, "
                    "int/float/str | None, list[int/float/str])")


def _parse(spec: _Spec, text: str) -> Any:
    """Text -> one value (one item, for a list); raises ValueError with the problem ("is not an integer")."""
    if spec.optional and text == "":
        return None
    kind = spec.kind
    if kind is bool:
        value = _BOOL_WORDS.get(text.strip().lower())
        if value is None:
            raise ValueError("is not a boolean (1/0, true/false, yes/no)")
        return value
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("is not a number") from None
    return text


def _check_choice(spec: _Spec, value: Any) -> None:
    choices = spec.option.choices
    if choices is not None and value is not None and value not in choices:
        raise ValueError(f"is not one of {', '.join(map(str, choices))}")


def _flag_type(spec: _Spec) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return _parse(spec, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None

    convert.__name__ = spec.kind.__name__  # argparse names the type in some messages
    return convert


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "none"
    return str(value)


def _help(spec: _Spec, env_var: str | None) -> str:
    opt = spec.option
    if opt.remainder:
        return opt.help.replace("%", "%%")
    parts = []
    if spec.kind is bool:
        if spec.has_default():
            parts.append(f"default: {spec.name} {_show(spec.default())}")
        if env_var:
            parts.append(f"env {env_var}=1|0")
    else:
        if spec.has_default():
            parts.append(f"default: {opt.default_text or _show(spec.default())}")
        else:
            parts.append("required")
        if env_var:
            parts.append(f"env {env_var}" + (", comma-separated" if spec.is_list else ""))
    if spec.is_list:
        parts.append("repeatable")
    text = f"{opt.help} ({'; '.join(parts)})" if opt.help else f"({'; '.join(parts)})"
    return text.replace("%", "%%")  # argparse %-formats help strings


@dataclasses.dataclass(frozen=True, slots=True)
class FlagDoc:
    """What `add_flags` declared for one argparse action, for generated documentation (docs/flags.md)."""

    help: str  # the field's help, without the "(default: ...; env ...)" that --help appends
    default: str | None  # as --help shows it ("off" for a switch); None: required (or a remainder positional)
    env_var: str | None  # the environment variable, or None


_FLAG_DOC = "specserve_flag_doc"  # the attribute of an argparse action that holds its FlagDoc


def flag_doc(action: argparse.Action) -> FlagDoc | None:
    """The FlagDoc of an action made by `add_flags`; None for an action added some other way."""
    doc = getattr(action, _FLAG_DOC, None)
    return doc if isinstance(doc, FlagDoc) else None


def _flag_doc(spec: _Spec, env_var: str | None) -> FlagDoc:
    if spec.option.remainder or not spec.has_default():
        default = None
    elif spec.kind is bool:  # a switch is off unless given; a --no-name one leaves its setting on
        default = f"{spec.name.replace('_', ' ')} on" if spec.option.negate else "off"
    else:
        default = spec.option.default_text or _show(spec.default())
    return FlagDoc(spec.option.help, default, env_var)


def _metavar(spec: _Spec) -> str | None:
    if spec.option.choices is not None:
        return None  # argparse shows {a,b,c}
    return spec.flag.lstrip("-").replace("-", "_").upper()  # "--slo-class" -> SLO_CLASS (not the field name)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
              env_prefix: str | None) -> None:
    """One argparse argument per field of the dataclass `cls`, in field order.

    No environment variable is read here, and no default is put into the namespace: a flag that
    is not given leaves no attribute (argparse.SUPPRESS), so `from_args` can tell it was not given.
    `env_prefix=None`: the settings have no environment variables. `flag_doc(action)` gives each
    action's help, default and variable apart (docs/flags.md is generated from them)."""
    for spec in _specs(cls):
        opt = spec.option
        help_text = _help(spec, spec.env_var(env_prefix))
        if opt.remainder:
            action = parser.add_argument(spec.name, nargs=argparse.REMAINDER, help=help_text)
        elif spec.kind is bool:
            action = parser.add_argument(spec.flag, *opt.aliases, dest=spec.name, action="store_const",
                                         const=not opt.negate, default=argparse.SUPPRESS, help=help_text)
        else:
            action = parser.add_argument(spec.flag, *opt.aliases, dest=spec.name, type=_flag_type(spec),
                                         choices=opt.choices, action="append" if spec.is_list else "store",
                                         default=argparse.SUPPRESS, metavar=opt.metavar or _metavar(spec),
                                         help=help_text)
        setattr(action, _FLAG_DOC, _flag_doc(spec, spec.env_var(env_prefix)))


def _from_env(spec: _Spec, var: str, text: str) -> Any:
    try:
        if spec.is_list:
            values = [_parse(spec, item.strip()) for item in text.split(",") if item.strip()]
            for value in values:
                _check_choice(spec, value)
            return values
        value = _parse(spec, text)
        _check_choice(spec, value)
        return value
    except ValueError as exc:
        raise SettingsError(f"{var}={text!r} {exc}") from None


def values(cls: type, args: argparse.Namespace | None, env_prefix: str | None,
           environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Each field's value: the command line's if given, else the environment's, else the default."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for spec in _specs(cls):
        given = getattr(args, spec.name, argparse.SUPPRESS) if args is not None else argparse.SUPPRESS
        var = spec.env_var(env_prefix)
        if given is not argparse.SUPPRESS:
            out[spec.name] = given
        elif var is not None and var in environ:
            out[spec.name] = _from_env(spec, var, environ[var])
        elif spec.has_default():
            out[spec.name] = spec.default()
        else:
            raise SettingsError(f"{spec.flag} is required" + (f" (or set {var})" if var else ""))
    return out


def from_args(cls: type, args: argparse.Namespace | None, env_prefix: str | None,
              environ: Mapping[str, str] | None = None) -> Any:
    """`cls(**values)`: see `values`. Raises SettingsError for a bad or missing environment value."""
    return cls(**values(cls, args, env_prefix, environ))


class Settings:
    """Mixin for a config dataclass: `add_flags(parser)` and `from_args(args)` as classmethods.

    A subclass sets `env_prefix = "SPECSERVE_GATEWAY_"` (None: no environment variables)."""

    __slots__ = ()
    env_prefix: ClassVar[str | None] = None

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_flags(parser, cls, cls.env_prefix)

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, environ: Mapping[str, str] | None = None) -> Self:
        config: Self = from_args(cls, args, cls.env_prefix, environ)
        return config
