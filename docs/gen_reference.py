"""The documentation's generated reference pages, built from the code so that they cannot drift from it.

- `reference/cli.md`: every command of `servelm` and of `python -m servelm.ray`, from their argparse parsers;
- `reference/configuration.md`: every key of the serve config tree (engine, server, admission) with its flag,
  env var, default, whether it can change at run time, and its help text, from the config dataclasses;
- `reference/metrics.md`: every Prometheus metric the server registers, with its type, labels and help.

The mkdocs hook (`docs/hooks.py`) adds these pages to each build; nothing is written into `docs/`. To look at
them without mkdocs: `python docs/gen_reference.py OUTDIR`. `tests/project/test_docs.py` builds the site and checks
that the CLI and configuration pages list every flag of `servelm serve`.

Classes and functions are found by where the source defines them (not by a fixed module path), so moving a
module inside the package does not break the docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "servelm"

_defined: dict[str, str] = {}


def _module_defining(pattern: str) -> object:
    """Import the one servelm module whose source has a line matching `pattern` (e.g. r"class Metrics\\b")."""
    if pattern not in _defined:
        rx = re.compile(r"^" + pattern, re.M)
        hits = sorted(p for p in PACKAGE.rglob("*.py") if rx.search(p.read_text(encoding="utf-8")))
        if len(hits) != 1:
            raise LookupError(f"expected one module under servelm/ matching {pattern!r}, found {hits}")
        rel = hits[0].relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        _defined[pattern] = ".".join(parts)
    return importlib.import_module(_defined[pattern])


def _find(name: str, kind: str = "class") -> object:
    return getattr(_module_defining(rf"{kind} {name}\b"), name)


# ---------------------------------------------------------------------------------------------------- text


def _cell(text: object) -> str:
    """Plain text made safe for a Markdown table cell (no emphasis, links or HTML by accident)."""
    s = " ".join(str(text).split())
    for ch in "\\`*_[]<>|":
        s = s.replace(ch, "\\" + ch)
    return s


def _code(text: object) -> str:
    s = str(text).replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _default(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return _code(str(value).lower())
    if value == "":
        return '`""`'
    return _code(value)


def _anchor(title: str) -> str:
    """The id Python-Markdown's toc extension gives a heading (its default slugify)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


# ------------------------------------------------------------------------------------------ command line


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command, parser) for `servelm`, each subcommand at any depth, and `python -m servelm.ray`."""
    main = _find("build_parser", "def")()
    out: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(cmd: str, p: argparse.ArgumentParser) -> None:
        out.append((cmd, p))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{cmd} {name}", sub)

    walk("servelm", main)
    ray = argparse.ArgumentParser(prog="python -m servelm.ray", add_help=False)
    _find("add_ray_args", "def")(ray)
    out.append(("python -m servelm.ray", ray))
    return out


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = "" if not action.help else parser._get_formatter()._expand_help(action)
    if action.choices is not None and not isinstance(action.choices, dict) and "{" not in text:
        text += (" " if text else "") + "one of: " + ", ".join(map(str, action.choices))
    default = action.default
    if (default not in (None, False, argparse.SUPPRESS) and action.nargs != 0 and "default" not in text
            and not isinstance(action, argparse._VersionAction)):
        text += f" (default: {default})"
    return text.strip()


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    if not action.option_strings:
        return action.dest
    return {int: "INT", float: "NUMBER"}.get(action.type, "VALUE")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return _code(_metavar(action))
    arg = ""
    if action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction):
        arg = f" {_metavar(action)}" if action.nargs in (None, 1) else f" {_metavar(action)} ..."
    return ", ".join(_code(s + arg) for s in action.option_strings)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            rows += [(name, helps.get(name, "")) for name in action.choices]
    return rows


def cli_reference() -> str:
    parsers = _parsers()
    lines = [
        "# Command-line reference",
        "",
        "Generated from the argparse parsers each time the documentation is built, so it lists exactly the",
        "commands and flags of this version. The same text, wrapped for a terminal, is what `--help` prints;",
        "[Command line](../getting-started/command-line.md) shows the commands at work, and",
        "[Configuration keys](configuration.md) lists every `servelm serve` setting with its env var and",
        "config-file key.",
        "",
        "Commands: " + ", ".join(f"[`{cmd}`](#{_anchor(cmd)})" for cmd, _ in parsers) + ".",
        "",
    ]
    for cmd, parser in parsers:
        lines += [f"## {cmd}", ""]
        if cmd == "python -m servelm.ray":
            lines += ["`servelm serve` on a Ray cluster ([Ray](../deployment/ray.md)): it takes every option of",
                      "[`servelm serve`](#servelm-serve) and these, which say where the engine replicas run and",
                      "how many:", ""]
        elif parser.description:
            lines += [_cell(parser.description), ""]
        positionals = [a for a in parser._actions if not a.option_strings
                       and not isinstance(a, argparse._SubParsersAction)]
        usage = cmd + " [options]"
        for a in positionals:
            name = _metavar(a) if a.metavar is not None or a.choices is not None else a.dest.upper()
            usage += {"?": f" [{name}]", "*": f" [{name} ...]", "+": f" {name} ..."}.get(a.nargs, f" {name}")
        subs = _subcommands(parser)
        if subs:
            usage = cmd + " [options] COMMAND ..."
        lines += ["```text", usage, "```", ""]
        if subs:
            lines += ["| command | what it does |", "| --- | --- |"]
            lines += [f"| [`{cmd} {name}`](#{_anchor(cmd + ' ' + name)}) | {_cell(h)} |" for name, h in subs]
            lines.append("")
        for group in parser._action_groups:
            actions = [a for a in group._group_actions
                       if not isinstance(a, argparse._SubParsersAction) and a.help != argparse.SUPPRESS]
            if not actions:
                continue
            title = group.title or "options"
            lines += [f"**{title}**", "", "| argument | meaning |", "| --- | --- |"]
            for a in actions:
                lines.append(f"| {_flags(a)} | {_cell(_help(parser, a))} |")
            lines.append("")
        if parser.epilog:
            lines += ["```text", parser.epilog.strip(), "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- configuration


def config_reference() -> str:
    settings = _module_defining(r"SECTIONS: dict")
    sections: dict[str, type] = settings.SECTIONS
    env_var = settings.env_var
    titles = {cls.__name__: " ".join((cls.__doc__ or "").split()) for cls in sections.values()}
    lines = [
        "# Configuration keys",
        "",
        "Generated from the config dataclasses each time the documentation is built. Every key can be set in",
        "the config file (`--config FILE`, YAML, TOML or JSON, under its section), by its env var or by its",
        "flag; the precedence is **flag > env var > file > default** ([Configuration](../serving/configuration.md)).",
        "A key is written flat (`block_size`: the flag, the env var, `LLM(...)`'s keyword) or under its section",
        "(`cache.block_size`); the older `engine:` and `server:` sections of the file take the keys of their",
        "sections flat. Keys marked *run time* can also be changed while serving, with `PATCH /admin/config`.",
        "The engine's keys (sections " + ", ".join(f"`{s}`" for s in settings.GROUPS["engine"].SECTIONS) + ")",
        "are also the keyword arguments of `LLM(...)` and the engine flags of `servelm generate`,",
        "`servelm chat` and `servelm bench throughput`.",
        "",
        "Sections: " + ", ".join(f"[`{s}`](#{s})" for s in sections) + ".",
        "",
    ]
    for sec, cls in sections.items():
        lines += [f"## {sec}", "", titles[cls.__name__], "",
                  "| key | flag | env var | default | run time | meaning |",
                  "| --- | --- | --- | --- | --- | --- |"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            is_bool = hints[f.name] in (bool, bool | None)  # an on/off flag and its --no- form
            flags = f"{_code(flag)}, {_code('--no-' + flag[2:])}" if is_bool else _code(flag)
            runtime = "yes" if f.metadata.get("runtime") else "no"
            lines.append(f"| {_code(sec + '.' + f.name)} | {flags} | {_code(env_var(f.name))} | "
                         f"{_default(f.default)} | {runtime} | {_cell(f.metadata.get('help', ''))} |")
        lines.append("")
    lines += ["`servelm serve` also takes `MODEL` (the `model.model` key), `--config FILE` (or `SERVELM_CONFIG`)",
              "and `--print-config`; a config file may also hold a `models:` list",
              "([Model platform](../platform/index.md)).", ""]
    always_on = _module_defining(r"VLLM_ALWAYS_ON = ").VLLM_ALWAYS_ON
    translated = _module_defining(r"VLLM_TRANSLATED = ").VLLM_TRANSLATED
    one_way = _module_defining(r"VLLM_ONE_WAY = ").VLLM_ONE_WAY
    lines += ["## vLLM flags", "",
              "Flags of vLLM's command line that `servelm serve` takes with no key of their own "
              "([vLLM differences](../serving/vllm-differences.md#vllm-serve-flags)):", "",
              "| flag | what |", "| --- | --- |",
              "| `--disable-log-requests`, `--enable-log-requests` | `log_requests` false and true |",
              "| `-tp` | `tensor_parallel_size` |",
              *(f"| `{flag}` | {_cell(what)} |" for flag, what in translated.items()),
              *(f"| `{flag}` | accepted and named at start, not needed: {_cell(why)} |"
                for flag, why in always_on.items()),
              *(f"| `{flag}` | {', '.join(_code(v) for v in values)} accepted and named at start, not needed; "
                f"vLLM's other values refused: {_cell(what)} |" for flag, (values, what) in one_way.items()), ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- metrics


def _families() -> list[tuple[str, list[tuple[str, str, tuple[str, ...], str]]]]:
    """(group title, [(exposed name, type, labels, help)]) for every metric the server registers."""
    metrics = _find("Metrics")("m")
    registry = metrics.registry
    groups = [("Engine, requests and HTTP", list(registry._collector_to_names))]
    before = set(groups[0][1])
    _find("TrafficMetrics")(registry, SimpleNamespace(canaries={}, mirrors={}, drift={}, watch=None))
    traffic = [c for c in registry._collector_to_names if c not in before]
    groups.append(("Traffic management, drift and webhooks (servers with a registry)", traffic))
    before |= set(traffic)
    _find("OipModels")(SimpleNamespace(metrics=metrics))
    groups.append(("Open Inference Protocol (non-LLM models)",
                   [c for c in registry._collector_to_names if c not in before]))
    out = []
    for title, collectors in groups:
        rows = []
        for c in collectors:
            if hasattr(c, "_labelnames") and hasattr(c, "_type"):  # Counter, Gauge, Histogram
                fams = [(c._name, c._type, tuple(c._labelnames), c._documentation)]
            else:  # a collector of gauges read at scrape time
                fams = [(m.name, m.type, tuple(getattr(m, "_labelnames", ())), m.documentation) for m in c.collect()]
            for name, kind, labels, doc in fams:
                exposed = name + "_total" if kind == "counter" and not name.endswith("_total") else name
                rows.append((exposed, kind, labels, doc))
        out.append((title, rows))
    return out


def metrics_reference() -> str:
    lines = [
        "# Metrics reference",
        "",
        "Generated from the metrics the server registers, each time the documentation is built. `GET /metrics`",
        "serves them in the Prometheus text format; names follow vLLM's under `servelm:` where vLLM has one, so",
        "dashboards and routers carry over. Histograms expose `_bucket`, `_sum` and `_count` series. Per-model",
        "series carry the model's `model_name` label (one series per served model). With API keys configured,",
        "`/metrics` needs no key unless the server runs with `--metrics-require-key`. How to use them:",
        "[Observability](../deployment/observability.md).",
        "",
    ]
    for title, rows in _families():
        lines += [f"## {title}", "", "| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
        for name, kind, labels, doc in rows:
            lab = ", ".join(_code(x) for x in labels) or "none"
            lines.append(f"| {_code(name)} | {kind} | {lab} | {_cell(doc)} |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- pages


def pages() -> dict[str, str]:
    """Site path -> Markdown of every generated page."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return {"reference/cli.md": cli_reference(), "reference/configuration.md": config_reference(),
            "reference/metrics.md": metrics_reference()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the generated reference pages into a folder.")
    p.add_argument("out", type=Path, help="folder to write reference/*.md into")
    args = p.parse_args(argv)
    for rel, text in pages().items():
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
