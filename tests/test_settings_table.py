"""docs/operations.md lists every setting with the default the code gives it."""

from __future__ import annotations

from tests.settings_table import documented, markdown, rows


def test_the_operations_settings_table_is_the_codes() -> None:
    assert documented() == markdown(), (
        "docs/operations.md's settings table differs from the config classes: "
        "run python -m tests.settings_table --write"
    )


def test_the_table_has_every_process_setting() -> None:
    listed = rows()
    for env in ("MODEL_ID", "MAX_INFLIGHT_REQUESTS", "WARM_START", "FAKE_STEP_DELAY_S"):
        assert env in listed
    assert listed["WORKER_ENDPOINT"][0] == ["worker", "frontend, supervisor"]
