"""Shared behaviour of the command-line entry points and tools: one argument style, one clear line for a user error, not
a traceback.

Every tool takes ``key=value`` words, as ``train.py`` and ``eval.py`` do. A tool declares its options (:class:`Option`:
name, type, default, help, allowed values) and calls :func:`run_tool`, which parses the words (:func:`parse_options`),
prints the options for ``--help``/``-h``, and turns a :class:`~moh_vision.errors.ConfigError` (bad arguments or input)
into ``error: <one line>`` and exit status 2, a :class:`~moh_vision.errors.RunError` into status 1."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from moh_vision.errors import ConfigError, RunError, error_in_chain, os_error_line

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def user_error_in(err: BaseException) -> Optional[Exception]:
    """The ConfigError/RunError behind ``err`` (Hydra's instantiate wraps errors raised by constructors)."""
    return error_in_chain(err, lambda e: isinstance(e, (ConfigError, RunError)))


def run_cli(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; a user error becomes one ``error:`` line on stderr and exit status 2 (1 for a RunError, and for a
    failed read or write that names its cause: ``<path>: No space left on device``). A RunError or a traceback is also
    recorded in the run's log file (``train.log``), which a rejected configuration never creates."""
    try:
        return fn(*args)
    except Exception as err:
        user_error = user_error_in(err)
        system_error = os_error_line(err) if user_error is None else None
        if not isinstance(user_error, ConfigError):
            _log_to_files(f"error: {user_error}" if user_error else "the run failed:",
                          exc_info=None if user_error else sys.exc_info())
        if user_error is None and system_error is None:
            raise
        print(f"error: {user_error or system_error}", file=sys.stderr)
        sys.exit(2 if isinstance(user_error, ConfigError) else 1)


def _log_to_files(message: str, exc_info: Any = None) -> None:
    """Write ``message`` (and a traceback) into the root logger's log files only: the console gets the one ``error:``
    line or Python's own traceback, not a second copy."""
    record = logging.getLogger(__name__).makeRecord(__name__, logging.ERROR, __file__, 0, message, (), exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# -- Value types: a parser from text, and what it accepts (for --help and error lines) ---------------------------------
def value_type(expects: str) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    def mark(parse: Callable[[str], Any]) -> Callable[[str], Any]:
        parse.expects = expects
        return parse
    return mark


@value_type("int")
def integer(text: str) -> int:
    return int(text)


@value_type("float")
def number(text: str) -> float:
    return float(text)


@value_type("text")
def text(value: str) -> str:
    return value


@value_type("true|false")
def boolean(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "yes", "on", "1"):
        return True
    if lowered in ("false", "no", "off", "0"):
        return False
    raise ValueError(value)


@value_type("value")
def yaml_value(value: str) -> Any:
    return yaml.safe_load(value)


def _items(value: str) -> List[str]:
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    items = [item.strip() for item in inner.split(",") if item.strip()]
    if not items:
        raise ValueError(value)
    return items


def list_of(item: Callable[[str], Any], single: bool = False) -> Callable[[str], Any]:
    """Comma-separated values (``a,b`` or ``[a,b]``); ``single``: one value stays a scalar."""
    def parse(value: str) -> Any:
        values = [item(v) for v in _items(value)]
        return values[0] if single and len(values) == 1 else values
    one = getattr(item, "expects", item.__name__)
    parse.expects = f"{one} or {one},{one},..." if single else f"{one},{one},..."
    return parse


# -- Options and parsing -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One ``key=value`` option. A name ending in ``.*`` is a group: ``attention.<key>=<value>`` words are collected
    (values parsed as YAML) into a dict under ``<name>_options`` (``attention_options``)."""
    name: str
    default: Any = None
    type: Callable[[str], Any] = text
    help: str = ""
    choices: Tuple[Any, ...] = ()
    required: bool = False
    minimum: Optional[float] = None
    aliases: Tuple[str, ...] = ()

    @property
    def is_group(self) -> bool:
        return self.name.endswith(".*")

    @property
    def dest(self) -> str:
        return self.name[:-2].replace(".", "_") + "_options" if self.is_group else self.name

    def parse(self, value: str) -> Any:
        if value.lower() in ("null", "none") and not self.required and self.default is None:
            return None
        try:
            parsed = self.type(value)
        except (ValueError, TypeError, yaml.YAMLError):
            raise ConfigError(f"{self.name}={value}: expected {self.expects()}") from None
        for one in parsed if isinstance(parsed, list) else [parsed]:
            if self.choices and one not in self.choices:
                raise ConfigError(f"{self.name}={value}: use one of {', '.join(map(str, self.choices))}")
            if self.minimum is not None and one < self.minimum:
                raise ConfigError(f"{self.name}={value}: must be at least {self.minimum:g}")
        return parsed

    def expects(self) -> str:
        return getattr(self.type, "expects", getattr(self.type, "__name__", "a value"))

    def usage(self) -> str:
        key = f"{self.name[:-2]}.<key>=<value>" if self.is_group else f"{self.name}=<{self.expects()}>"
        if self.choices:
            key = f"{self.name}={'|'.join(map(str, self.choices))}"
        default = "required" if self.required else "" if self.default in (None, [], {}) else \
            f"default {format_value(self.default)}"
        return f"  {key}\n      {self.help}{f' ({default})' if default else ''}"


def format_value(value: Any) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return str(value)


class Options(dict):
    """Parsed options: ``opts["name"]`` or ``opts.name``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _is_passthrough(key: str, passthrough: Sequence[str]) -> bool:
    bare = key.lstrip("+~")
    return any(bare == prefix or bare.startswith(prefix + ".") for prefix in passthrough)


def help_text(options: Sequence[Option], doc: str = "", passthrough: Sequence[str] = ()) -> str:
    lines = [doc.strip(), "", "options (key=value words):"] if doc else ["options (key=value words):"]
    lines += [option.usage() for option in options]
    if passthrough:
        lines.append("  " + ", ".join(f"{p}=..., {p}.<key>=..." for p in passthrough)
                     + "\n      passed to Hydra as overrides of the run's configuration")
    return "\n".join(lines)


def parse_options(argv: Sequence[str], options: Sequence[Option], doc: str = "",
                  passthrough: Sequence[str] = ()) -> Tuple[Options, List[str]]:
    """``key=value`` words -> (options, Hydra overrides whose key is one of ``passthrough`` or below it).
    ``--help``/``-h`` prints the options and exits 0. Unknown keys, bad values and missing required options raise a
    one-line :class:`ConfigError` naming the key, the value and what is allowed."""
    by_key: Dict[str, Option] = {}
    for option in options:
        for key in (option.name, *option.aliases):
            by_key[key] = option
    values = Options({o.dest: {} if o.is_group else list(o.default) if isinstance(o.default, list) else o.default
                      for o in options})
    given, overrides = set(), []
    for word in argv:
        if word in ("-h", "--help"):
            print(help_text(options, doc, passthrough))
            sys.exit(0)
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ConfigError(f"arguments are key=value words (e.g. {options[0].name}=...); got '{word}'")
        if _is_passthrough(key, passthrough):
            overrides.append(word)
            continue
        group = next((o for o in options if o.is_group and key.startswith(o.name[:-1])), None)
        option = by_key.get(key)
        if option is None and group is None:
            known = [o.name.replace(".*", ".<key>") for o in options] + [f"{p}, {p}.<key>" for p in passthrough]
            raise ConfigError(f"unknown option '{key}' ({word}); options: {', '.join(known)}")
        if option is None:
            values[group.dest][key[len(group.name) - 1:]] = group.parse(value)
            continue
        if option.name in given:
            raise ConfigError(f"{option.name} is given twice ({word})")
        given.add(option.name)
        values[option.dest] = option.parse(value)
    missing = [o.name for o in options if o.required and values[o.dest] is None]
    if missing:
        raise ConfigError("; ".join(f"{m}= is required ({by_key[m].help or by_key[m].expects()})" for m in missing))
    return values, overrides


def run_tool(fn: Callable[..., Any], argv: Optional[Sequence[str]], options: Sequence[Option], doc: str = "",
             passthrough: Sequence[str] = ()) -> Any:
    """Parse ``argv`` (default ``sys.argv[1:]``) and return ``fn(options)`` (with ``passthrough``:
    ``fn(options, overrides)``); user errors exit as :func:`run_cli` says."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    words = list(sys.argv[1:] if argv is None else argv)

    def call() -> Any:
        opts, overrides = parse_options(words, options, doc, passthrough)
        return fn(opts, overrides) if passthrough else fn(opts)
    return run_cli(call)


# -- The configuration groups, as the command line composes them -------------------------------------------------------
def attention_config(name: Optional[str], options: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The ``attention`` group as ``train.py attention=<name> attention.<key>=...`` composes it (None: none)."""
    if name is None:
        if options:
            raise ConfigError("attention.<option> needs attention=<name>")
        return None
    path = CONFIG_DIR / "attention" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"attention={name} is unknown; known: {', '.join(known)}")
    cfg = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(options or {}) - set(cfg))
    if unknown:
        raise ConfigError(f"attention={name} has no option(s) {', '.join(unknown)}; it has: {', '.join(sorted(cfg))}")
    return {**cfg, **(options or {})}
