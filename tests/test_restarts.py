"""A worker or frontend that dies, hangs or is too slow loses no request."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from protocol.exit_codes import ExitCode
from tests.sse import sse_events
from tests.stack import Stack, free_port, running_stack
from worker.engine.fake_engine import expected_text

CAPACITY = 4


def _post(stack: Stack, body: dict[str, object], timeout_s: float = 60) -> httpx.Response:
    return httpx.post(f"{stack.url}/generate", json=body, timeout=timeout_s)


def _wait_for_stop(stack: Stack, timeout_s: float = 10.0) -> None:
    """Wait for the worker told to stop to exit; if it does not, fail with its
    threads' stacks (SIGUSR1 writes them to its log), to say where it hangs."""
    worker = stack.processes["worker"]
    try:
        worker.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        worker.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        raise AssertionError(
            f"the worker did not stop within {timeout_s:g} s:\n{stack.log('worker')[-20_000:]}"
        ) from None


def _in_background(
    stack: Stack, bodies: list[dict[str, object]]
) -> tuple[ThreadPoolExecutor, list[Future[httpx.Response]]]:
    pool = ThreadPoolExecutor(max_workers=len(bodies))
    return pool, [pool.submit(_post, stack, body) for body in bodies]


def _bodies(count: int, max_new_tokens: int) -> list[dict[str, object]]:
    return [{"prompt": f"in flight {i}", "max_new_tokens": max_new_tokens} for i in range(count)]


def _assert_fault_free_answers(
    bodies: list[dict[str, object]], futures: list[Future[httpx.Response]]
) -> None:
    for body, future in zip(bodies, futures, strict=True):
        response = future.result(timeout=60)
        assert response.status_code == 200, response.text
        expected = expected_text(str(body["prompt"]), int(str(body["max_new_tokens"])))
        assert response.json()["text"] == expected


def test_kill_9_with_twice_capacity_in_flight_loses_nothing(tmp_path: Path) -> None:
    overrides = {"MAX_BATCH_SIZE": str(CAPACITY), "FAKE_STEP_DELAY_S": "0.02"}
    with running_stack(tmp_path, overrides) as stack:
        first = stack.wait_live()
        bodies = _bodies(3 * CAPACITY, max_new_tokens=40)
        pool, futures = _in_background(stack, bodies)
        stack.wait_for_health("all in flight", lambda h: h["inflight"] == len(bodies))
        stack.wait_for_health("slots busy", lambda h: h["active"] == CAPACITY)
        stack.signal_worker(signal.SIGKILL)
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        health = stack.wait_live(instance_not=str(first["instance_id"]))
        assert health["worker_restarts"] == 1
        assert health["inflight"] == 0
        # The worker held about what it ran; the rest waited in the frontend for a slot.
        assert "closed its connection: replaying" in stack.log("supervisor")


def test_a_worker_told_to_stop_hands_its_requests_back_uncounted_as_a_death(
    tmp_path: Path,
) -> None:
    """SIGTERM (docker stop, a rolling restart) cost the requests a worker held
    a death each, as a kill does: with MAX_WORKER_DEATHS=1 they failed with 500
    workers_died. They go back to the frontend, and on, resumed: those that
    wait at once, those that run once STOP_GRACE_S is over (60 tokens take
    1.2 s)."""
    overrides = {
        "MAX_BATCH_SIZE": str(CAPACITY),
        "FAKE_STEP_DELAY_S": "0.02",
        "MAX_WORKER_DEATHS": "1",
        "STOP_GRACE_S": "0.5",
    }
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_live()
        bodies = _bodies(2 * CAPACITY, max_new_tokens=60)
        pool, futures = _in_background(stack, bodies)
        for _ in range(2):
            health = stack.wait_for_health("slots busy", lambda h: h["active"] == CAPACITY)
            stack.signal_worker(signal.SIGTERM)
            stack.wait_live(instance_not=str(health["instance_id"]))
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        log = stack.log("supervisor")
        assert "handing" in log and "requests back to their frontends" in log
        assert "that died (" not in log  # none was failed for deaths


def test_requests_sent_to_a_worker_as_it_stops_are_handed_back_too(tmp_path: Path) -> None:
    """A frontend that held nothing there has not heard that the worker stops,
    and sends on until its connection closes: those requests were lost in the
    closing socket, and counted a death each."""
    overrides = {"FAKE_STEP_DELAY_S": "0.02", "MAX_WORKER_DEATHS": "1"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        for round_ in range(3):
            stack.wait_live()
            stack.processes["worker"].send_signal(signal.SIGTERM)
            time.sleep(0.02)
            bodies = [
                {"prompt": f"round {round_} request {i}", "max_new_tokens": 5} for i in range(4)
            ]
            pool, futures = _in_background(stack, bodies)
            _wait_for_stop(stack)
            stack.start("worker", "worker.serve.main")
            _assert_fault_free_answers(bodies, futures)
            pool.shutdown()


def test_a_worker_stopping_with_nothing_to_hand_back_is_not_declared_dead(
    tmp_path: Path,
) -> None:
    """The frontend learned of a stop only from a request handed back: one that
    had none there logged the closed connection as a death, an ERROR at every
    rolling restart. The worker's heartbeats now say it is stopping."""
    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.02"}, supervised=False) as stack:
        stack.wait_live()
        stack.processes["worker"].send_signal(signal.SIGTERM)
        _wait_for_stop(stack)
        deadline = time.monotonic() + 10
        while "closed its connection" not in (log := stack.log("frontend")):
            assert time.monotonic() < deadline, log
            time.sleep(0.05)
        assert "closed its connection as it stopped" in log
        assert "declared dead" not in log


def test_the_frontend_logs_how_many_requests_a_stopping_worker_handed_back(
    tmp_path: Path,
) -> None:
    """A death logs its replays; a stop logged no count, which only the
    worker's own log had."""
    overrides = {"FAKE_STEP_DELAY_S": "0.02", "STOP_GRACE_S": "0"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        bodies = _bodies(3, max_new_tokens=400)
        pool, futures = _in_background(stack, bodies)
        stack.wait_for_health("all running", lambda h: h["active"] == 3)
        stack.processes["worker"].send_signal(signal.SIGTERM)
        _wait_for_stop(stack)
        stack.start("worker", "worker.serve.main")
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        log = stack.log("frontend")
        assert "closed its connection as it stopped, having handed back 3 request(s)" in log


def test_while_its_only_worker_stops_the_frontend_is_not_ready(tmp_path: Path) -> None:
    """/ready said 200, "live", for the whole of the worker's grace, while new
    requests could only wait."""
    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.05"}, supervised=False) as stack:
        stack.wait_live()
        pool, futures = _in_background(stack, _bodies(1, max_new_tokens=400))
        stack.wait_for_health("running", lambda h: h["active"] == 1)
        stack.processes["worker"].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2  # within its 3 s grace
        while (ready := httpx.get(f"{stack.url}/ready", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "still ready while its worker stops"
            time.sleep(0.05)
        assert (ready.status_code, ready.json()["status"]) == (503, "stopping")
        assert [worker["stopping"] for worker in ready.json()["workers"]] == [True]
        _wait_for_stop(stack)
        stack.start("worker", "worker.serve.main")
        _assert_fault_free_answers(_bodies(1, max_new_tokens=400), futures)
        pool.shutdown()


def test_a_stopped_worker_is_declared_dead_and_replaced(tmp_path: Path) -> None:
    overrides = {"MAX_BATCH_SIZE": str(CAPACITY), "FAKE_STEP_DELAY_S": "0.02"}
    with running_stack(tmp_path, overrides) as stack:
        first = stack.wait_live()
        bodies = _bodies(2 * CAPACITY, max_new_tokens=30)
        pool, futures = _in_background(stack, bodies)
        stack.wait_for_health("slots busy", lambda h: h["active"] == CAPACITY)
        stack.signal_worker(signal.SIGSTOP)
        stack.wait_for_health("dead verdict", lambda h: h["worker"] == "dead")
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        stack.wait_live(instance_not=str(first["instance_id"]))
        assert "killing worker" in stack.log("supervisor")


def test_a_worker_without_progress_is_declared_hung(tmp_path: Path) -> None:
    # Each step takes longer than STEP_TIMEOUT_S, but the worker's heartbeats go on.
    overrides = {"FAKE_STEP_DELAY_S": "4", "STEP_TIMEOUT_S": "1.5", "HEARTBEAT_TIMEOUT_S": "3"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        pool, futures = _in_background(stack, _bodies(1, max_new_tokens=5))
        stack.wait_for_health("hung verdict", lambda h: h["worker"] == "hung")
        assert "made no progress" in stack.health().json()["reason"]
        for future in futures:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)


def test_a_hung_worker_is_replaced(tmp_path: Path) -> None:
    overrides = {"FAKE_STEP_DELAY_S": "4", "STEP_TIMEOUT_S": "1.5", "HEARTBEAT_TIMEOUT_S": "3"}
    with running_stack(tmp_path, overrides) as stack:
        first = stack.wait_live()
        pool, futures = _in_background(stack, _bodies(1, max_new_tokens=5))
        stack.wait_for_health(
            "a replacement worker",
            lambda h: h["instance_id"] not in (None, first["instance_id"]),
        )
        assert "made no progress" in stack.log("supervisor")
        for future in futures:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)


def test_past_its_deadline_a_request_gets_504_and_its_slot_is_freed(tmp_path: Path) -> None:
    overrides = {"REQUEST_TIMEOUT_S": "1", "FAKE_STEP_DELAY_S": "0.05"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        started = time.monotonic()
        response = _post(stack, {"prompt": "slow", "max_new_tokens": 200})
        assert response.status_code == 504
        message = response.json()["error"]["message"]
        assert "REQUEST_TIMEOUT_S=1" in message and message.endswith("); ask for fewer tokens")
        # It ran: clients are told not to send it again, and so are readers.
        assert response.headers["x-should-retry"] == "false"
        assert time.monotonic() - started < 5
        stack.wait_for_health("slot freed", lambda h: h["active"] == 0, 2)
        # A chat that set no max_tokens is told to set one, not to ask for fewer.
        chat = {"model": "fake", "messages": [{"role": "user", "content": "slow"}]}
        response = httpx.post(f"{stack.url}/v1/chat/completions", json=chat, timeout=30)
        assert response.status_code == 504
        message = response.json()["error"]["message"]
        assert message.endswith(
            "); set max_tokens: none was set, so it may write up to "
            "MAX_NEW_TOKENS_LIMIT=512 tokens, as the context window allows"
        ), message


def test_past_its_deadline_without_a_worker_a_request_is_told_to_retry(tmp_path: Path) -> None:
    overrides = {"REQUEST_TIMEOUT_S": "0.5"}
    with running_stack(tmp_path, overrides, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        response = _post(stack, {"prompt": "nobody", "max_new_tokens": 4})
    assert response.status_code == 504
    message = response.json()["error"]["message"]
    assert "no worker" in message and message.endswith("; retry later")


def test_requests_wait_for_a_worker_and_succeed_when_it_arrives(tmp_path: Path) -> None:
    with running_stack(tmp_path, supervised=False, start=("frontend",)) as stack:
        stack.wait_answering()
        ready = httpx.get(f"{stack.url}/ready", timeout=5)
        assert ready.status_code == 503
        bodies = _bodies(3, max_new_tokens=4)
        pool, futures = _in_background(stack, bodies)
        stack.wait_for_health("requests waiting", lambda h: h["inflight"] == 3)
        stack.start("worker", "worker.serve.main")
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        assert httpx.get(f"{stack.url}/ready", timeout=5).status_code == 200


def test_after_a_frontend_restart_the_worker_frees_the_lost_slots_and_serves(
    tmp_path: Path,
) -> None:
    overrides = {"FRONTEND_TIMEOUT_S": "1", "FAKE_STEP_DELAY_S": "0.05"}
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_live()
        pool, futures = _in_background(stack, _bodies(2, max_new_tokens=400))
        stack.wait_for_health("slots busy", lambda h: h["active"] == 2)
        os.kill(stack.frontend_pid(), signal.SIGKILL)
        for future in futures:
            assert isinstance(future.exception(timeout=30), httpx.TransportError)
        pool.shutdown()
        stack.wait_live()
        response = _post(stack, {"prompt": "new frontend", "max_new_tokens": 3})
        assert response.json()["text"] == expected_text("new frontend", 3)
        stack.wait_for_health("orphans aborted", lambda h: h["active"] == 0, 5)


def test_a_setting_the_worker_refuses_stops_the_stack_at_once_naming_it(tmp_path: Path) -> None:
    # Each of three starts would fail the same way: the first exit ends it.
    with running_stack(tmp_path, {"MAX_BATCH_SIZE": "0", "CRASH_LOOP_LIMIT": "3"}) as stack:
        supervisor = stack.processes["supervisor"]
        try:
            code = supervisor.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor still retrying\n{stack.logs()}") from None
        assert code == ExitCode.CONFIG_ERROR  # passed on, for a restart policy to see
        log = stack.log("supervisor")
        assert "worker: configuration error: MAX_BATCH_SIZE must be > 0" in log
        assert "giving up: worker refused its configuration (exit code 78)" in log
        assert "restart #" not in log


@pytest.mark.parametrize(
    ("process", "message"),
    [
        ("frontend", "frontend: configuration error: cannot listen on 127.0.0.1 port {port}"),
        # Refused before anything starts: the frontends served through the other
        # program's worker until this stack's own failed to bind.
        ("worker", "supervisor: configuration error: port {port} of the workers'"),
    ],
)
def test_a_port_another_program_holds_stops_the_stack_at_once_naming_it(
    tmp_path: Path, process: str, message: str
) -> None:
    port = free_port()
    setting = {
        "frontend": {"PORT": str(port)},
        "worker": {"WORKER_ENDPOINT": f"tcp://127.0.0.1:{port}"},
    }
    overrides = {**setting[process], "CRASH_LOOP_LIMIT": "3"}
    with socket.create_server(("127.0.0.1", port)), running_stack(tmp_path, overrides) as stack:
        try:
            code = stack.processes["supervisor"].wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor still retrying\n{stack.logs()}") from None
        assert code == ExitCode.CONFIG_ERROR  # passed on, for a restart policy to see
        log = stack.log("supervisor")
        assert message.format(port=port) in log
        if process == "frontend":
            assert "giving up: frontend refused its configuration (exit code 78)" in log
        assert "restart #" not in log


def test_a_worker_started_alone_on_a_port_in_use_says_so_before_loading_its_model(
    tmp_path: Path,
) -> None:
    """It found the port taken only when it bound, once its model had loaded."""
    port = free_port()
    overrides = {"WORKER_ENDPOINT": f"tcp://127.0.0.1:{port}", "FAKE_START_DELAY_S": "60"}
    with (
        socket.create_server(("127.0.0.1", port)),
        running_stack(tmp_path, overrides, supervised=False, start=("worker",)) as stack,
    ):
        try:
            code = stack.processes["worker"].wait(timeout=20)  # not the model's 60 s
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the worker is loading its model\n{stack.logs()}") from None
        assert code == ExitCode.CONFIG_ERROR
        assert f"port {port} (WORKER_ENDPOINT=tcp://127.0.0.1:{port}) is taken" in stack.log(
            "worker"
        )


def test_a_wedged_engine_makes_the_worker_exit_for_its_restart_policy(tmp_path: Path) -> None:
    # No supervisor here, as under Docker: the worker's own watchdog must act.
    overrides = {"FAKE_STEP_DELAY_S": "30", "ENGINE_WATCHDOG_S": "1"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        pool, _ = _in_background(stack, _bodies(1, max_new_tokens=5))
        code = stack.processes["worker"].wait(timeout=15)
        assert code == 3
        assert "the engine made no progress" in stack.log("worker")
        pool.shutdown(wait=False, cancel_futures=True)


def test_a_stream_cut_by_a_worker_kill_continues_where_it_stopped(tmp_path: Path) -> None:
    overrides = {"FAKE_STEP_DELAY_S": "0.03"}
    prompt, budget = "a stream that outlives its worker", 80
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_live()
        body = {"prompt": prompt, "max_new_tokens": budget, "stream": True}
        texts: list[str] = []
        done: dict[str, object] = {}
        with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=60) as response:
            for event, text in sse_events(response):
                data = json.loads(text)
                if event == "token":
                    texts.append(data["text"])
                    if len(texts) == 10:
                        stack.signal_worker(signal.SIGKILL)
                elif event == "done":
                    done = data
                else:
                    raise AssertionError(f"unexpected {event} event: {data}")
        assert "".join(texts) == expected_text(prompt, budget)
        assert done["finish_reason"] == "length"
        assert done["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": budget}
        assert "replaying 1 request(s)" in stack.log("supervisor")


def test_a_choice_that_only_waited_in_the_queue_of_a_killed_worker_is_no_suspect(
    tmp_path: Path,
) -> None:
    """Two choices, one slot: the second waits in the worker's queue while the
    first runs. Killed twice, the worker held no suspect either time (a suspect
    would go alone, one at a time), and both choices come out whole."""
    overrides = {"MAX_BATCH_SIZE": "1", "FAKE_STEP_DELAY_S": "0.03"}
    prompt, budget = "two choices for one slot", 60
    body = {"model": "fake", "prompt": prompt, "max_tokens": budget, "n": 2, "stream": True}
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_live()
        texts = ["", ""]
        kill_at = [10, 25]  # characters of the first choice; the second waits meanwhile
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as response:
            for _, data in sse_events(response):
                if data == "[DONE]":
                    break
                (choice,) = json.loads(data)["choices"]
                texts[choice["index"]] += choice["text"]
                if kill_at and len(texts[0]) >= kill_at[0]:
                    kill_at.pop(0)
                    stack.signal_worker(signal.SIGKILL)
        assert not kill_at
        assert texts == [expected_text(prompt, budget)] * 2
        assert stack.log("supervisor").count("replaying 2 request(s), 0 of them one at a time") == 2


def test_max_worker_deaths_bounds_the_replays_of_a_request_that_made_progress(
    tmp_path: Path,
) -> None:
    overrides = {"FAKE_STEP_DELAY_S": "0.03", "MAX_WORKER_DEATHS": "1"}
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_live()
        body = {"prompt": "one death is enough", "max_new_tokens": 80, "stream": True}
        events: list[tuple[str, dict[str, object]]] = []
        with httpx.stream("POST", f"{stack.url}/generate", json=body, timeout=60) as response:
            for event, text in sse_events(response):
                events.append((event, json.loads(text)))
                if len(events) == 10:
                    stack.signal_worker(signal.SIGKILL)
        event, data = events[-1]
        assert event == "error", events[-1]
        assert "in flight on a worker that died" in str(data)
        assert "failing it" in stack.log("supervisor")


def test_a_frontend_the_worker_timed_out_resends_what_the_worker_dropped(tmp_path: Path) -> None:
    overrides = {"FRONTEND_TIMEOUT_S": "0.5", "FAKE_STEP_DELAY_S": "0.02"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live()
        bodies = _bodies(2, max_new_tokens=150)
        pool, futures = _in_background(stack, bodies)
        stack.wait_for_health("slots busy", lambda h: h["active"] == 2)
        frontend = stack.processes["frontend"]
        frontend.send_signal(signal.SIGSTOP)  # its pings stop; the worker drops its requests
        dropped = "aborting its 2 requests"
        stack.wait_until(lambda: dropped in stack.log("worker"), dropped)
        frontend.send_signal(signal.SIGCONT)
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        assert "greeted this frontend again" in stack.log("frontend")


def test_a_worker_that_was_only_late_keeps_its_requests(tmp_path: Path) -> None:
    # No supervisor: the frozen worker is declared dead but not replaced, then thaws.
    overrides = {"FAKE_STEP_DELAY_S": "0.02"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        first = stack.wait_live()
        bodies = _bodies(2, max_new_tokens=100)
        pool, futures = _in_background(stack, bodies)
        stack.wait_for_health("slots busy", lambda h: h["active"] == 2)
        worker = stack.processes["worker"]
        worker.send_signal(signal.SIGSTOP)
        declared = f"worker at {stack.worker_endpoint} declared dead: no heartbeat from worker"
        stack.wait_until(lambda: declared in stack.log("frontend"), declared)
        worker.send_signal(signal.SIGCONT)
        _assert_fault_free_answers(bodies, futures)
        pool.shutdown()
        health = stack.wait_live()
        assert (health["instance_id"], health["worker_restarts"]) == (first["instance_id"], 0)
        assert "worker is live again" in stack.log("frontend")
        assert "replaying" not in stack.log("frontend")


def test_a_request_that_kills_every_worker_is_failed_after_two_or_three_and_the_rest_succeed(
    tmp_path: Path,
) -> None:
    """Sent in a burst: where it was admitted beside newcomers, its first death
    says nothing of which killed the worker, and its two trials' deaths fail it
    (tests/test_scale.py sends one alone, failed after two)."""
    overrides = {"FAKE_CRASH_PROMPT": "poison", "FAKE_STEP_DELAY_S": "0.02"}
    with running_stack(tmp_path, overrides) as stack:
        first = stack.wait_live()
        innocents = _bodies(6, max_new_tokens=30)
        poison = {"prompt": "a poison pill", "max_new_tokens": 30}
        pool, futures = _in_background(stack, [*innocents[:3], poison, *innocents[3:]])
        answers = [future.result(timeout=60) for future in futures]
        pool.shutdown()
        poisoned = answers.pop(3)
        assert poisoned.status_code == 500
        assert poisoned.json()["error"]["code"] == "workers_died"
        killed = re.search(r"in flight on (\d) workers", poisoned.json()["error"]["message"])
        assert killed is not None and int(killed.group(1)) in (2, 3), poisoned.text
        for body, answer in zip(innocents, answers, strict=True):
            assert answer.status_code == 200, answer.text
            assert answer.json()["text"] == expected_text(str(body["prompt"]), 30)
        health = stack.wait_live(instance_not=str(first["instance_id"]))
        assert health["worker_restarts"] == int(killed.group(1))
        assert health["inflight"] == 0


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_worker_serves_on(
    tmp_path: Path,
) -> None:
    """How to see where a worker that seems stuck is (a stop that never ended)."""
    with running_stack(tmp_path, supervised=False) as stack:
        stack.wait_live()
        stack.processes["worker"].send_signal(signal.SIGUSR1)
        stack.wait_until(lambda: "engine_loop.py" in stack.log("worker"), "a stack dump")
        assert "io_loop.py" in stack.log("worker")  # the other thread's too
        body = {"prompt": "hi", "max_new_tokens": 2}
        assert httpx.post(f"{stack.url}/generate", json=body, timeout=10).status_code == 200
