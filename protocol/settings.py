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
import functools
import logging
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Any, NoReturn, TypeVar

from protocol.exit_codes import ExitCode
from protocol.lifeline import SUPERVISOR_PID_ENV

log = logging.getLogger(__name__)

# The largest number any setting takes: counts, bytes and seconds all fit (68
# years of seconds), and so does everything the wire carries of them.
MAX_SETTING = 2**31 - 1


# Every variable any process reads (a test holds it to the config classes, and to
# the few variables read elsewhere): another process's setting in this one's
# environment, from a shared .env or compose file, is no misspelling of its own.
ALL_VARIABLES = frozenset(
    [
        "API_KEY",
        "BFLOAT16_PRODUCTS",
        "BODY_TIMEOUT_S",
        "CHAT_TEMPLATE",
        "CRASH_LOOP_LIMIT",
        "CUDA_GRAPHS",
        "CURVE_CLIENT_KEYS",
        "CURVE_CLIENT_SECRET_KEY",
        "CURVE_SERVER_PUBLIC_KEY",
        "CURVE_SERVER_SECRET_KEY",
        "DEVICE",
        "DTYPE",
        "ENGINE_WATCHDOG_S",
        "FAKE_CRASH_PROMPT",
        "FAKE_START_DELAY_S",
        "FAKE_STEP_DELAY_S",
        "FRONTEND_TIMEOUT_S",
        "HEADER_TIMEOUT_S",
        "HEARTBEAT_INTERVAL_S",
        "HEARTBEAT_TIMEOUT_S",
        "HOST",
        "KEEP_ALIVE_TIMEOUT_S",
        "KERNELS_DIR",
        "KERNEL_ISA",
        "MAX_BATCH_SIZE",
        "MAX_CONNECTIONS",
        "MAX_INFLIGHT_REQUESTS",
        "MAX_MESSAGE_BYTES",
        "MAX_NEW_TOKENS_LIMIT",
        "MAX_QUEUE_DEPTH",
        "MAX_REQUEST_BYTES",
        "MAX_WORKER_DEATHS",
        "MINIBATCH_SUPERVISOR_PID",
        "MODEL_ID",
        "NUM_FRONTENDS",
        "NUM_WORKERS",
        "PING_INTERVAL_S",
        "PORT",
        "PREFILL_CHUNK_TOKENS",
        "PREFIX_CACHE",
        "REQUEST_TIMEOUT_S",
        "RESTART_BACKOFF_MAX_S",
        "RESTART_BACKOFF_S",
        "STEP_TIMEOUT_S",
        "STOP_GRACE_S",
        "STRICT_REQUEST_FIELDS",
        "TORCH_THREADS",
        "WARM_START",
        "WEIGHTS",
        "WORKER_BIND",
        "WORKER_ENDPOINT",
        "WORKER_ENDPOINTS",
        "WORKER_RESOLVE_INTERVAL_S",
        "WORKER_START_TIMEOUT_S",
    ]
)
# A variable one slip (a letter wrong, missing, extra, or two swapped) from one of
# these, or one of several words in lower case, is told as its misspelling, if
# long enough that the slip is no other word (HOSTS and PORTS are others').
_MIN_MISSPELT_CHARS = 6
_told_misspelt: set[str] = set()  # once a process, whichever of its configs it loads


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
    return {
        f.metadata["env"]: flag_of(f)
        for f in dataclasses.fields(cls)
        if getattr(args, f.name, None) is not None
    }


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


def read_curve_keys(
    config: object, *settings: tuple[str, Callable[[str], Any]]
) -> list[Any] | None:
    """Read the CURVE settings ``(field name, reader)``: None when all are unset
    (CURVE off), every key when all are set, and a ConfigError otherwise."""
    given = {name: getattr(config, name) for name, _ in settings if getattr(config, name)}
    if not given:
        return None
    if len(given) < len(settings):
        (missing,) = (name for name, _ in settings if name not in given)
        raise ConfigError(
            f"{env_name(type(config), missing)} is unset, but "
            f"{', '.join(env_name(type(config), name) for name in given)} is set: CURVE "
            "needs both (minibatch-keys writes them), or neither to leave it off"
        )
    keys = []
    for name, read in settings:
        try:
            keys.append(read(given[name]))
        except ValueError as exc:
            raise ConfigError(f"{env_name(type(config), name)}: {exc}") from None
    return keys


# A Unix socket's path, less its terminating NUL (sockaddr_un.sun_path on Linux).
MAX_IPC_PATH_BYTES = 107
MAX_PORT = 65535
# Where the worker listens, and its clients connect, unless WORKER_ENDPOINT says.
DEFAULT_WORKER_ENDPOINT = "tcp://127.0.0.1:5555"


def check_endpoint(config: object, name: str, endpoint: str | None = None) -> None:
    """Raises ConfigError naming the setting ``name`` unless ``endpoint`` (by
    default the setting's value; one of its items for a list) is a ZMQ endpoint,
    a tcp:// one with a port from 1 to MAX_PORT."""
    endpoint = getattr(config, name) if endpoint is None else endpoint
    check_endpoint_value(endpoint, env_name(type(config), name))


def check_endpoint_value(endpoint: str, env: str) -> None:
    """`check_endpoint` for a value that ``env`` (a setting, or a flag) gave."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(
            f"{env} must be a ZMQ endpoint such as {DEFAULT_WORKER_ENDPOINT}, got {endpoint!r}"
        )
    path = endpoint.removeprefix("ipc://")
    if endpoint.startswith("ipc://") and not path:
        raise ConfigError(f"{env} names no socket path: ipc:///run/minibatch.sock is one")
    if endpoint.startswith("ipc://") and len(path.encode()) > MAX_IPC_PATH_BYTES:
        raise ConfigError(
            f"{env} names a socket path of {len(path.encode())} bytes; the system allows "
            f"{MAX_IPC_PATH_BYTES}: choose a shorter path, got {endpoint!r}"
        )
    if not endpoint.startswith("tcp://"):
        return
    # libzmq takes a port past 65535 modulo 65536 (99999 listens on 34463), and
    # 0 or * for a port the system picks: either way, not where clients look.
    _, colon, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not (colon and port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT):
        raise ConfigError(
            f"{env} must end in a port from 1 to {MAX_PORT}, as tcp://127.0.0.1:5555 does, "
            f"got {endpoint!r}"
        )


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
        _warn_misspelt(environ)
    return config


def _warn_misspelt(environ: Mapping[str, str]) -> None:
    """Warn, once a process, of each variable in ``environ`` that no process reads
    but that is a slip from one that one does: MAX_BACTH_SIZE=4 was ignored
    without a word, where a misspelt flag is refused naming the one it meant. A
    process that a supervisor started leaves it to the supervisor, which said it
    once for every process it starts."""
    if environ.get(SUPERVISOR_PID_ENV, str(os.getpid())) != str(os.getpid()):
        return
    for name in sorted(environ.keys() - ALL_VARIABLES - _told_misspelt):
        if len(name) < _MIN_MISSPELT_CHARS:
            continue
        meant = [
            known
            for known in _variables_by_length().get(len(name), [])
            if _is_one_slip(name, known) or _is_lower_case_of(name, known)
        ]
        if meant:
            _told_misspelt.add(name)
            log.warning("%s is no setting, and is ignored: did you mean %s?", name, meant[0])


@functools.cache
def _variables_by_length() -> dict[int, list[str]]:
    """ALL_VARIABLES by the lengths of their slips: one letter more or less at most."""
    by_length: dict[int, list[str]] = {}
    for known in sorted(ALL_VARIABLES):
        for length in range(len(known) - 1, len(known) + 2):
            by_length.setdefault(length, []).append(known)
    return by_length


def _is_lower_case_of(typed: str, meant: str) -> bool:
    """model_id for MODEL_ID; not port for PORT, a word other tools use."""
    return "_" in meant and typed.upper() == meant and typed != meant


def _is_one_slip(typed: str, meant: str) -> bool:
    """Whether ``typed`` is ``meant`` with one letter wrong, missing or extra, or
    two neighbours swapped."""
    if typed == meant or abs(len(typed) - len(meant)) > 1:
        return False
    start = 0  # the first difference
    while start < min(len(typed), len(meant)) and typed[start] == meant[start]:
        start += 1
    rest_typed, rest_meant = typed[start:], meant[start:]
    return (
        rest_typed[1:] == rest_meant[1:]  # wrong
        or rest_typed[1:] == rest_meant  # extra
        or rest_typed == rest_meant[1:]  # missing
        or (rest_typed[:2] == rest_meant[1::-1] and rest_typed[2:] == rest_meant[2:])  # swapped
    )


def _refuse_unknown_flags(
    parser: argparse.ArgumentParser, cls: type[Any], argv: Sequence[str] | None
) -> None:
    """Stop at the first flag ``cls`` has not (a usage error, exit 2), naming the
    one it likely meant, or else saying it is no flag of this process: argparse's
    bare "unrecognized arguments" left a user of a renamed flag (the worker's
    --endpoint, now --worker-endpoint), or of another process's setting
    (MAX_BATCH_SIZE to a frontend), guessing."""
    unknown = unknown_flags(cls, argv)
    if not unknown:
        return
    given = unknown[0].split("=", 1)[0]
    meant = difflib.get_close_matches(given, own_flags(cls), n=1, cutoff=0.7)
    if meant:
        parser.error(f"unrecognized argument {given}: did you mean {meant[0]}?")
    env = variable_of_flag(given)
    if env is not None:
        # Another process's (--max-batch-size to a frontend), or one without a flag.
        parser.error(
            f"unrecognized argument {given}: {parser.prog} has no such flag, but {env} "
            "is read from the environment: set it there, for the process that reads it "
            "(docs/operations.md's table says which)"
        )
    parser.error(
        f"unrecognized argument {given}: not a flag of {parser.prog}, whose --help "
        "lists its own; each process takes only the settings it reads "
        "(docs/operations.md's table says which)"
    )


def own_flags(cls: type[Any]) -> list[str]:
    """``cls``'s flags: ``--max-batch-size`` for MAX_BATCH_SIZE, and so on."""
    return [flag_of(f) for f in dataclasses.fields(cls)]


def variable_of_flag(flag: str) -> str | None:
    """The variable a flag spelt after it names (``--api-key``: API_KEY), if any
    process reads it: it may be another process's, or have no flag."""
    env = flag.lstrip("-").upper().replace("-", "_")
    return env if env in ALL_VARIABLES and env != SUPERVISOR_PID_ENV else None


def flag_settings(cls: type[Any], argv: Sequence[str] | None = None) -> dict[str, str]:
    """The variables that ``argv``'s flags set, as the environment would set them:
    for a process that passes its settings on to the processes it starts."""
    args = _parser(cls).parse_args(argv)
    return {
        f.metadata["env"]: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if getattr(args, f.name, None) is not None
    }


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
    but those in its ``WITHOUT_FLAGS`` (settings it inherits only to refuse them);
    its ``HELP_EPILOG``, if any, ends --help."""
    parser = argparse.ArgumentParser(
        description=description, epilog=getattr(cls, "HELP_EPILOG", None), add_help=add_help
    )
    without_flags: frozenset[str] = getattr(cls, "WITHOUT_FLAGS", frozenset())
    for f in dataclasses.fields(cls):
        if f.name in without_flags:
            continue
        env = f.metadata["env"]
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
