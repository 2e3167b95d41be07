"""docs/operations.md lists every setting, and README.md the main ones, with the
default the code gives each."""

from __future__ import annotations

import dataclasses
import re

from protocol.client_config import WorkerClientConfig
from protocol.lifeline import SUPERVISOR_PID_ENV
from protocol.variables import ALL_VARIABLES
from tests.settings_table import (
    MAIN_SETTINGS,
    READERS,
    README,
    REPO,
    documented,
    markdown,
    rows,
)
from worker.serve.readiness import READY_SOCKET_ENV


def test_the_operations_settings_table_is_the_codes() -> None:
    assert documented() == markdown(), (
        "docs/operations.md's settings table differs from the config classes: "
        "run python -m tests.settings_table --write"
    )


def test_the_readmes_table_of_the_main_settings_is_the_codes() -> None:
    assert documented(README) == markdown(MAIN_SETTINGS), (
        "README.md's settings table differs from the config classes: "
        "run python -m tests.settings_table --write"
    )


def test_the_table_has_every_process_setting() -> None:
    listed = rows()
    for env in ("MODEL_ID", "MAX_INFLIGHT_REQUESTS", "WARM_START", "FAKE_STEP_DELAY_S"):
        assert env in listed
    assert listed["WORKER_ENDPOINT"][0] == ["worker", "frontend", "supervisor"]
    # Each reader's meaning, where they differ: the supervisor's NUM_WORKERS is
    # how many it runs, not only how many share the memory.
    num_workers = listed["NUM_WORKERS"][2]
    assert num_workers.startswith("worker: ") and "; supervisor: workers to run" in num_workers


def test_a_setting_read_by_several_processes_has_one_default_and_type() -> None:
    """WORKER_ENDPOINT, PORT, TORCH_THREADS and NUM_WORKERS are fields of two or
    three config classes: the table shows one default, so each must have it
    (their helps may differ: the table shows each process's)."""
    meanings: dict[str, set[tuple[str, str]]] = {}
    for config in (*(config for config, _ in READERS), WorkerClientConfig):
        for field in dataclasses.fields(config):
            meaning = (repr(field.default), str(field.type))
            meanings.setdefault(field.metadata["env"], set()).add(meaning)
    differing = {env: meaning for env, meaning in meanings.items() if len(meaning) > 1}
    assert not differing


# What the code reads of the environment by name, outside the config classes.
_READ_BY_NAME = re.compile(r'environ(?:\.get)?[(\[]"([A-Z][A-Z0-9_]*)"')
OTHER_TOOLS_VARIABLES = {"ATEN_CPU_CAPABILITY", "CXX", "HF_ENDPOINT", "HF_HUB_OFFLINE"}  # theirs


def test_every_variable_a_process_reads_is_known_to_every_process() -> None:
    """So that no process takes another's setting for a misspelling of its own:
    every config class's, and every variable the code reads by name."""
    read = {
        field.metadata["env"]
        for config in (*(config for config, _ in READERS), WorkerClientConfig)
        for field in dataclasses.fields(config)
    }
    for package in ("frontend", "worker", "protocol"):
        for source in (REPO / package).rglob("*.py"):
            read |= set(_READ_BY_NAME.findall(source.read_text())) - OTHER_TOOLS_VARIABLES
    read |= {SUPERVISOR_PID_ENV, READY_SOCKET_ENV}  # read by their constants' names
    assert read == ALL_VARIABLES, "add the new variable to protocol.variables.ALL_VARIABLES"
