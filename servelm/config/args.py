"""Command-line flags from the config dataclasses: one flag per field, with the field's default and help."""

from __future__ import annotations

import argparse
import dataclasses

from servelm.config.engine import ENGINE_FIELDS, ENGINE_SECTIONS, EngineConfig, choices, token_count

# vLLM's short flags, beside the long ones
SHORT_FLAGS = {"tensor_parallel_size": "-tp"}


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = (),
                    suppress_defaults: bool = False, description: str | None = None) -> None:
    """One flag per field of a config dataclass (one section), with its default and help taken from the config
    itself, in an argument group of --help titled by the section (described by the class's docstring).

    With suppress_defaults, flags left out are absent from the namespace, so a file or env var can set them.
    """
    import typing

    if all(f.name in skip for f in dataclasses.fields(cls)):
        return
    group = parser.add_argument_group(title, description if description is not None else section_help(cls))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = (SHORT_FLAGS[f.name], flag) if f.name in SHORT_FLAGS else (flag,)
        helptext = f.metadata.get("help", "")
        if "(default" not in helptext and "default:" not in helptext:  # some say what None stands for
            helptext += f" (default: {f.default})"
        default = argparse.SUPPRESS if suppress_defaults else f.default
        tp = hints[f.name]
        optional = _is_union(tp) and type(None) in typing.get_args(tp)
        base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if _is_union(tp) else tp
        helptext = helptext.replace("%", "%%")
        if base is bool:
            group.add_argument(*flags, default=default, action=argparse.BooleanOptionalAction, help=helptext)
        elif typing.get_origin(base) is tuple:  # several values: --flag a b (see settings.py's _coerce)
            group.add_argument(*flags, nargs="+", default=default, metavar=f.name.upper(), help=helptext)
        elif f.metadata.get("token_count"):
            group.add_argument(*flags, type=_token_count_arg(optional), default=default,
                               metavar=f.name.upper(), help=helptext)
        elif choices(base) is not None:  # the config's validation names what is allowed (and vLLM's aliases)
            group.add_argument(*flags, type=str, default=default, metavar=f.name.upper(), help=helptext)
        else:
            group.add_argument(*flags, type=base, default=default, help=helptext)


def _is_union(tp) -> bool:
    """X | Y (or Optional[X]), as opposed to a generic such as tuple[str, ...]."""
    import types
    import typing

    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _token_count_arg(auto: bool):
    """argparse's type for a token-count field: 32k, 32K, 32000 (and auto or -1 for None where allowed)."""
    def token_count_value(text: str) -> int | None:
        try:
            return token_count(text, auto)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return token_count_value


def section_help(cls: type) -> str:
    """A section's docstring on one line: the description of its group in --help."""
    return " ".join((cls.__doc__ or "").split())


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """The engine's flags (flat names, as vLLM's), grouped in --help by the config section each sets."""
    for sec, cls in ENGINE_SECTIONS.items():
        add_config_args(parser, cls, f"{sec} config", skip=() if with_model else ("model",))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)})
