"""Every environment variable any process reads, and which one a variable that
none reads was likely meant to be: a misspelt setting is named, not ignored."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping

from protocol.lifeline import SUPERVISOR_PID_ENV

log = logging.getLogger(__name__)

# Every variable any process reads (a test holds it to the config classes, and to
# the few variables read elsewhere): another process's setting in this one's
# environment, from a shared .env or compose file, is no misspelling of its own.
ALL_VARIABLES = frozenset(
    [
        "API_KEY",
        "BFLOAT16_PRODUCTS",
        "BODY_TIMEOUT_S",
        "CHAT_TEMPLATE",
        "CORS_ALLOW_ORIGINS",
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
        "MINIBATCH_READY_SOCKET",
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
# Or one without its unit: HEARTBEAT_TIMEOUT for HEARTBEAT_TIMEOUT_S.
_UNITS = ("_S", "_BYTES")
_told_misspelt: set[str] = set()  # once a process, whichever of its configs it loads


def warn_of_misspellings(environ: Mapping[str, str]) -> None:
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
        meant = [name + unit for unit in _UNITS if name + unit in ALL_VARIABLES] + [
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
    two neighbours swapped. Stricter than the flags' difflib ratio
    (`protocol.settings.nearest_flag`): the environment holds every other tool's
    variables too, and a name merely near a setting (MODEL, WORKERS, DEVICE_ID) is no
    slip, as difflib would take it."""
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


def variable_of_flag(flag: str) -> str | None:
    """The variable a flag spelt after it names (``--api-key``: API_KEY), if any
    process reads it: it may be another process's, or have no flag."""
    env = flag.lstrip("-").upper().replace("-", "_")
    # MINIBATCH_*: what the supervisor tells its children, no setting of anyone's.
    return env if env in ALL_VARIABLES and not env.startswith("MINIBATCH_") else None
