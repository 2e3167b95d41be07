"""Heartbeats keep flowing while the worker takes the largest messages it allows."""

from __future__ import annotations

import pytest

from bench.heartbeat_gap import measure
from tests.model_fixtures import tiny_engine
from tests.stack import free_port
from worker.serve.config import WorkerConfig

MAX_GAP_S = 1.0  # well under HEARTBEAT_TIMEOUT_S (3 s): no false "dead"


@pytest.mark.model
def test_the_costliest_messages_leave_no_heartbeat_gap() -> None:
    config = WorkerConfig(
        model_id="synthetic",
        worker_endpoint=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_interval_s=0.05,
        max_message_bytes=4 * 1024 * 1024,
    )
    report = measure(tiny_engine(capacity=2), config, rounds=2)
    assert set(report.answer_s) == {
        "largest list of strings",
        "nested lists",
        "largest text prompt",
        "longest tokenized prompt",
        "largest id list",
    }
    assert report.max_gap_s < MAX_GAP_S
