"""The settings loader every process's config is built on.

Each process has one frozen dataclass, next to the code that reads it
(`worker.serve.config`, `frontend.config`, `worker.launch.config`; a client of
workers takes `protocol.client_config`). A field made with `setting` names its
environment variable; `load` reads the variables, lets command-line flags
override them (``--max-batch-size 4`` for MAX_BATCH_SIZE) and validates the
result. A bad value raises `ConfigError` naming the variable, and the entry
points exit with it (`exit_refusing`). The only module that reads the
environment for a config.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, NoReturn, TypeVar

from protocol.exit_codes import ExitCode
from protocol.variables import variable_of_flag, warn_of_misspellings

# The largest number any setting takes: counts, bytes and seconds all fit (68
# years of seconds), and so does everything the wire carries of them.
MAX_SETTING = 2**31 - 1


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


def exit_refusing(
    process: str,
    error: ConfigError,
    cls: type[Any] | None = None,
    argv: Sequence[str] | None = None,
) -> NoReturn:
    """Ends ``process`` with ``error``'s message and ExitCode.CONFIG_ERROR. Given
    the config class its ``argv`` was loaded into, the message names the flag
    that set each variable it names, as `load`'s own refusals do, for the checks
    of several settings made after it."""
    if cls is not None:
        error = naming_flags(error, flags_given(cls, argv))
    print(f"{process}: configuration error: {error}", file=sys.stderr)
    sys.exit(ExitCode.CONFIG_ERROR)


def naming_flags(error: ConfigError, flags: Mapping[str, str]) -> ConfigError:
    """``error``, naming the flag (of ``flags``: variable -> flag) that set each
    variable it names: `--max-batch-size 0` was refused as MAX_BATCH_SIZE, which
    was never set."""
    message = str(error)
    named = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", message))
    given = [
        f"{flag} sets {env}"
        for env, flag in flags.items()
        if env in named and f"{flag} sets {env}" not in message
    ]
    return ConfigError(f"{message} ({'; '.join(given)})") if given else error


def flags_given(cls: type[Any], argv: Sequence[str] | None = None) -> dict[str, str]:
    """The variables that ``argv``'s flags set, each with its flag (flags that
    are none of ``cls``'s, refused as such, are passed over)."""
    args, _ = _parser(cls).parse_known_args(argv)
    return _flags_set(cls, args)


def _flags_set(cls: type[Any], args: argparse.Namespace) -> dict[str, str]:
    return {f.metadata["env"]: flag_of(f) for f in _fields_given(cls, args)}


def _fields_given(cls: type[Any], args: argparse.Namespace) -> list[dataclasses.Field[Any]]:
    """``cls``'s settings that a flag in ``args`` sets."""
    return [f for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None]


def flag_of(f: dataclasses.Field[Any]) -> str:
    """A setting's flag: --max-batch-size for max_batch_size."""
    return "--" + f.name.replace("_", "-")


def _as_set(default: Any) -> str:
    """A default as one would set it: 1 and 0 for a flag, as the README writes them."""
    return str(int(default)) if isinstance(default, bool) else repr(default)


def setting(env: str, default: Any, help: str, is_secret: bool = False) -> Any:
    """A config field read from ``env``. A secret set to nothing is refused: it
    would turn off, without a word, what it guards (`load`)."""
    # A secret stays out of repr(), so that logging a config cannot leak it.
    metadata = {"env": env, "help": help, "is_secret": is_secret}
    return field(default=default, repr=not is_secret, metadata=metadata)


def require_positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            env = env_name(type(config), name)
            raise ConfigError(f"{env} must be > 0, got {getattr(config, name)!r}")


# The shortest interval a loop may wait between turns: less only spins a core.
MIN_INTERVAL_S = 0.01


def require_interval(config: object, *names: str) -> None:
    """Each of ``names`` is an interval in seconds of at least MIN_INTERVAL_S."""
    for name in names:
        if getattr(config, name) < MIN_INTERVAL_S:
            env = env_name(type(config), name)
            raise ConfigError(
                f"{env} must be at least {MIN_INTERVAL_S:g} s, got {getattr(config, name)!r}"
            )


def env_name(cls: type[Any], name: str) -> str:
    return str({f.name: f.metadata["env"] for f in dataclasses.fields(cls)}[name])


C = TypeVar("C")


def load(
    cls: type[C],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    description: str | None = None,
    warn_misspelt: bool = True,
) -> C:
    """Build ``cls`` from the environment, overridden by command-line flags; with
    ``warn_misspelt``, warn of variables that look like misspelt settings."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    parser = _parser(cls, description)
    _refuse_unknown_flags(parser, cls, argv)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    try:
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            env = f.metadata["env"]
            raw = getattr(args, f.name, None)  # None too where it has no flag (`_parser`)
            if raw is None:
                raw = environ.get(env)
            if raw is None:
                continue
            if f.metadata["is_secret"] and raw == "":
                # A .env line `API_KEY=` served the API to anyone.
                raise ConfigError(
                    f"{env} is set but empty, which would turn off what it guards: give "
                    "it a value, or unset it"
                )
            values[f.name] = _parse(env, raw, hints[f.name])
        config = cls(**values)
    except ConfigError as exc:
        raise naming_flags(exc, _flags_set(cls, args)) from None
    if warn_misspelt:
        warn_of_misspellings(environ)
    return config


def _refuse_unknown_flags(
    parser: argparse.ArgumentParser, cls: type[Any], argv: Sequence[str] | None
) -> None:
    """Stop at the first flag ``cls`` has not (a usage error, exit 2), saying why
    its ``WITHOUT_FLAGS`` has none, or that it is a flag of a process that
    inherits ``cls``'s environment (``INHERITED_BY``), or naming the flag it
    likely meant, or the variable to set instead, or else that it is no flag of
    this process: argparse's bare "unrecognized arguments" left a user of a
    renamed flag (the worker's --endpoint, now --worker-endpoint), or of another
    process's setting (MAX_BATCH_SIZE to a frontend), guessing."""
    unknown = unknown_flags(cls, argv)
    if not unknown:
        return
    flag, prog = unknown[0], parser.prog
    given = flag.split("=", 1)[0]
    without_flags: Mapping[str, str] = getattr(cls, "WITHOUT_FLAGS", {})
    own = setting_of_flag(cls, flag)
    if own is not None and own in without_flags:
        parser.error(f"unrecognized argument {given}: {without_flags[own]}")
    if own is not None:  # its own flag, after the "--" that ends them
        parser.error(f"unrecognized argument {given}: after --, which ends the flags")
    inherited_by: tuple[type[Any], ...] = getattr(cls, "INHERITED_BY", ())
    # A child's flag, even cut short as argparse would take it there (--max-batch).
    env = next(filter(None, (setting_of_flag(child, flag) for child in inherited_by)), None)
    meant = None if env else nearest_flag(cls, given)
    if meant:
        parser.error(f"unrecognized argument {given}: did you mean {meant}?")
    env = env or variable_of_flag(given)
    if env is None:
        parser.error(
            f"unrecognized argument {given}: not a flag of {prog}, whose --help "
            "lists its own; each process takes only the settings it reads "
            "(docs/operations.md's settings say which)"
        )
    where = (
        f"set it in {prog}'s environment (`{env}=... {prog}`), which the processes "
        "it starts inherit"
        if inherited_by
        # Another process's (--max-batch-size to a frontend), or one without a flag.
        else "set it there, for the process that reads it (see docs/operations.md's settings)"
    )
    parser.error(
        f"unrecognized argument {given}: {prog} has no such flag, but {env} is read "
        f"from the environment: {where}"
    )


def nearest_flag(cls: type[Any], given: str) -> str | None:
    """The flag of ``cls`` that ``given`` likely meant (``--max-bacth-size``,
    ``--worker_endpoint``, ``--PORT``), if one is close."""
    flags = [flag_of(f) for f in dataclasses.fields(cls)]
    meant = difflib.get_close_matches(given.lower(), flags, n=1, cutoff=0.7)
    return meant[0] if meant else None


def flag_settings(cls: type[Any], argv: Sequence[str] | None = None) -> dict[str, str]:
    """The variables that ``argv``'s flags set, as the environment would set them:
    for a process that passes its settings on to the processes it starts."""
    args = _parser(cls).parse_args(argv)
    return {f.metadata["env"]: getattr(args, f.name) for f in _fields_given(cls, args)}


def unknown_flags(cls: type[Any], argv: Sequence[str] | None = None) -> list[str]:
    """The options in ``argv`` that are none of ``cls``'s flags, as given."""
    given = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in given):
        return []  # --help is for `load` to print, whatever else is there
    unknown = _parser(cls, add_help=False).parse_known_args(argv)[1]
    return [arg for arg in unknown if arg.startswith("-") and arg != "--"]


def setting_of_flag(cls: type[Any], flag: str) -> str | None:
    """The variable that ``cls``'s flag ``flag`` sets (``--max-batch-size``, with
    ``=value`` or not, or cut short as argparse takes it: ``--max-batch``), or
    None if it has no such flag or several start so."""
    given = flag.split("=", 1)[0]
    envs = {flag_of(f): f.metadata["env"] for f in dataclasses.fields(cls)}
    if given in envs:
        return str(envs[given])
    matches = [env for name, env in envs.items() if name.startswith(given)]
    return str(matches[0]) if len(matches) == 1 and given.startswith("--") else None


def _parser(
    cls: type[Any], description: str | None = None, add_help: bool = True
) -> argparse.ArgumentParser:
    """A flag for each of ``cls``'s settings: ``--max-batch-size`` for MAX_BATCH_SIZE,
    but those in its ``WITHOUT_FLAGS`` (variable -> why it has no flag: settings it
    inherits only to refuse them); its ``HELP_EPILOG``, if any, ends --help. Its
    usage and errors name the process by its ``COMMAND``, also when it runs as
    ``python -m``, where argparse would name the file (``main.py``)."""
    parser = argparse.ArgumentParser(
        prog=getattr(cls, "COMMAND", None),
        description=description,
        epilog=getattr(cls, "HELP_EPILOG", None),
        add_help=add_help,
    )
    without_flags: Mapping[str, str] = getattr(cls, "WITHOUT_FLAGS", {})
    for f in dataclasses.fields(cls):
        env = f.metadata["env"]
        if env in without_flags:
            continue
        parser.add_argument(
            flag_of(f),
            dest=f.name,
            default=None,
            metavar=env,
            help=f"{f.metadata['help']} (env {env}, default {_as_set(f.default)})",
        )
    return parser


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLEANS.update({"0": False, "false": False, "no": False, "off": False})


def _parse(env: str, raw: str, kind: Any) -> Any:
    if kind is str:
        return raw
    if kind is bool:
        # Empty is refused, as for numbers: a .env line `PREFIX_CACHE=` read as
        # off turned off, without a word, what is on by default.
        if raw.strip().lower() not in _BOOLEANS:
            raise ConfigError(
                f"{env} must be 1 or 0 (true or false, yes or no, on or off), got {raw!r}; "
                "unset it for the default"
            )
        return _BOOLEANS[raw.strip().lower()]
    try:
        value = kind(raw)
    except ValueError:
        words = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{env} must be {words} ({kind.__name__}), got {raw!r}") from None
    # "nan" and "inf" parse as floats, and a huge int as an int: neither makes
    # sense as a count, a size or seconds, and each fails later, far from here
    # (a timeout that never fires, a number the wire cannot carry).
    if not (math.isfinite(value) and abs(value) <= MAX_SETTING):
        raise ConfigError(f"{env} must be a finite number of at most {MAX_SETTING:,}, got {raw!r}")
    return value
