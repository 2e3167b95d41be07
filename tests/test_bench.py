"""The benchmark tools, model-free: statistics, arrival schedules, load shapes, the
HTTP and ZMQ clients against a fake-engine stack, and the poison drill."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import signal
import socket
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import zmq

from bench import fault_drill, load, path_latency, zmq_client, zmq_load
from bench import stack as bench_stack
from bench.http_client import NATIVE, OPENAI, HttpTarget
from bench.report import (
    ISA_LIMITS,
    OK,
    RequestRecord,
    describe_machine,
    latency_stats,
    machine,
    summarize,
)
from bench.stack import free_port
from bench.zmq_client import LOST, ZmqTarget
from protocol import ErrorCode, ErrorResult, GenerateRequest, ToFrontend
from tests.stack import Stack, running_stack
from tests.stand_in_worker import StandInWorker
from worker.launch.warm_start import WORKER_TITLE


def test_latency_stats_are_milliseconds_with_interpolated_percentiles() -> None:
    stats = latency_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)
    assert latency_stats([0.25]) == {"mean": 250, "p50": 250, "p95": 250, "p99": 250}
    assert latency_stats([]) == {}


def test_a_result_taken_with_the_code_held_below_the_cpu_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert "isa_held_to" not in machine()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    described = machine()
    assert described["isa_held_to"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert describe_machine(described).endswith(", code held to ONEDNN_MAX_CPU_ISA=AVX2")


def test_summary_counts_tokens_of_successes_and_failures_by_status() -> None:
    records = [
        RequestRecord("a", sent_at=0.0, ended_at=1.0, num_tokens=10, chunk_times=[0.2, 0.6, 1.0]),
        RequestRecord("b", sent_at=1.0, ended_at=2.0, num_tokens=30),
        RequestRecord("c", sent_at=1.0, ended_at=1.5, status="503"),
    ]
    summary = summarize(records)
    assert summary["num_tokens"] == 40
    assert summary["tokens_per_s"] == pytest.approx(20.0)  # 40 tokens over 0..2 s
    assert summary["requests_per_s"] == pytest.approx(1.0)
    assert summary["failures_by_status"] == {"503": 1}
    assert summary["ttft_ms"]["p50"] == pytest.approx(200)
    assert summary["itl_ms"]["mean"] == pytest.approx(400)
    assert summary["path_overhead_ms"] == {}  # no record says what the worker took


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    offsets = load.arrival_offsets(4000, rate=20.0, burstiness=1.0, seed=3)
    assert offsets == load.arrival_offsets(4000, rate=20.0, burstiness=1.0, seed=3)
    assert offsets != load.arrival_offsets(4000, rate=20.0, burstiness=1.0, seed=4)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)
    # Exponential gaps: the spread equals the mean. Bursty arrivals spread more.
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)
    bursty = load.arrival_offsets(4000, rate=20.0, burstiness=0.25, seed=3)
    bursty_gaps = [b - a for a, b in zip([0.0, *bursty], bursty, strict=False)]
    assert statistics.stdev(bursty_gaps) > 1.5 * statistics.stdev(gaps)


def test_closed_loop_never_exceeds_its_concurrency() -> None:
    in_flight, peak = 0, 0

    async def send(request: GenerateRequest) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        record = RequestRecord(request.request_id, time.perf_counter())
        await asyncio.sleep(0.001)
        in_flight -= 1
        return record

    requests = [GenerateRequest(f"r{i}", "hi", 4) for i in range(20)]
    records = asyncio.run(load.closed_loop(send, requests, concurrency=3, show_progress=False))
    assert peak == 3
    assert sorted(r.request_id for r in records) == sorted(r.request_id for r in requests)


def _args(**overrides: object) -> SimpleNamespace:
    settings: dict[str, object] = {
        "requests": 6,
        "seed": 0,
        "prompt_words": (4, 12),
        "max_new_tokens": [3, 5],
        "mode": "closed",
        "concurrency": 3,
        "rate": 50.0,
        "burstiness": 1.0,
        "no_progress": True,
    }
    settings.update(overrides)
    return SimpleNamespace(**settings)


def _check(
    records: list[RequestRecord], requests: list[GenerateRequest], says_server_time: bool = True
) -> None:
    budgets = {r.request_id: r.max_new_tokens for r in requests}
    assert {r.request_id for r in records} == set(budgets)
    for record in records:
        assert record.status == OK
        assert record.num_tokens == budgets[record.request_id]
        assert record.chunk_times, "a streamed request records when its tokens came"
        assert record.sent_at < record.chunk_times[0] <= record.ended_at
        if says_server_time:  # every answer but OpenAI's says how long the worker took
            assert record.server_s is not None
            assert 0 < record.server_s < record.ended_at - record.sent_at


async def _run_http(
    base_url: str, api: str, requests: list[GenerateRequest], args: SimpleNamespace
) -> list[RequestRecord]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        target = HttpTarget(client, api)
        if api == OPENAI:
            assert await target.resolve_model() == "fake"
        return await load.drive(target.send, requests, args)


async def _run_zmq(
    endpoint: str, requests: list[GenerateRequest], args: SimpleNamespace
) -> list[RequestRecord]:
    async with ZmqTarget(endpoint) as target:
        assert target.hello is not None and target.hello.model == "fake"
        return await load.drive(target.send, requests, args)


def test_http_and_zmq_clients_against_a_fake_stack(tmp_path: Path) -> None:
    with running_stack(tmp_path, supervised=False) as stack:
        stack.wait_live()
        for api, mode in ((NATIVE, "closed"), (OPENAI, "open")):
            args = _args(mode=mode)
            requests = load.tagged_workload(args, tag=api)
            records = asyncio.run(_run_http(stack.url, api, requests, args))
            _check(records, requests, says_server_time=api == NATIVE)
            assert all(r.num_prompt_tokens for r in records), "both APIs answer with usage"
        args = _args()
        requests = load.tagged_workload(args, tag="zmq")
        _check(asyncio.run(_run_zmq(stack.env["WORKER_ENDPOINT"], requests, args)), requests)


def test_the_zmq_client_ends_what_a_replaced_worker_held_as_lost(tmp_path: Path) -> None:
    async def run(stack: Stack) -> list[RequestRecord]:
        async with ZmqTarget(stack.env["WORKER_ENDPOINT"]) as target:
            requests = [GenerateRequest(f"held-{i}", "hold", max_new_tokens=500) for i in range(3)]
            sent = [asyncio.create_task(target.send(request)) for request in requests]
            await asyncio.sleep(1.0)  # under way: the fake worker takes 0.05 s a step
            stack.signal_worker(signal.SIGKILL)  # the supervisor starts another at once
            return await asyncio.wait_for(asyncio.gather(*sent), timeout=30)

    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.05"}) as stack:
        stack.wait_live()
        records = asyncio.run(run(stack))
    assert [record.status for record in records] == [LOST] * 3


def test_the_zmq_client_ends_what_a_silent_worker_held_as_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker killed and not replaced: a load run waited for its requests for ever."""
    monkeypatch.setattr(zmq_client, "WORKER_SILENT_S", 0.5)
    monkeypatch.setattr(zmq_client, "PING_INTERVAL_S", 0.1)

    async def run(worker: StandInWorker) -> RequestRecord:
        async with ZmqTarget(worker.endpoint) as target:
            sent = asyncio.create_task(target.send(GenerateRequest("held", "hold", 8)))
            await asyncio.to_thread(worker.wait_for, lambda: bool(worker.received), "sent")
            await asyncio.to_thread(worker.__exit__)  # its heartbeats stop
            return await asyncio.wait_for(sent, timeout=10)

    with StandInWorker(lambda _: [], capacity=1) as worker:  # it never answers
        record = asyncio.run(run(worker))
    assert record.status == "dead"


def test_path_latency_reports_a_refused_request_rather_than_waiting_for_ever() -> None:
    def refuse(request: GenerateRequest) -> list[ToFrontend | bytes]:
        return [ErrorResult(request.request_id, ErrorCode.INVALID_REQUEST, "too long")]

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with StandInWorker(refuse, capacity=1) as worker:
        socket = path_latency.connect_worker(context, worker.endpoint, None)
        with pytest.raises(RuntimeError, match="the worker refused a request: too long"):
            path_latency.zmq_overhead_ms(socket, max_new_tokens=5)
        socket.close()
    context.term()


def test_path_latency_pings_while_it_waits_and_gives_up_on_a_silent_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It sent no ping while it waited: the worker dropped a request longer than
    its FRONTEND_TIMEOUT_S, and the client waited 30 s more."""
    monkeypatch.setattr(path_latency, "ZMQ_PING_INTERVAL_MS", 50)
    monkeypatch.setattr(path_latency, "ZMQ_SILENCE_S", 0.5)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with StandInWorker(lambda _: [], capacity=1) as worker:  # it never answers
        socket = path_latency.connect_worker(context, worker.endpoint, None)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(path_latency.zmq_overhead_ms, socket, 5)
            worker.wait_for(lambda: len(worker.pings) >= 3, "pinged while it waits")
            worker.__exit__()  # silent from now on
            with pytest.raises(RuntimeError, match=r"the worker said nothing for 0\.5 s"):
                waiting.result(timeout=10)
        socket.close()
    context.term()


def test_http_client_reports_a_refused_request_by_status(tmp_path: Path) -> None:
    with running_stack(tmp_path, supervised=False) as stack:
        stack.wait_live()

        async def run() -> RequestRecord:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                target = HttpTarget(client, NATIVE)
                return await target.send(GenerateRequest("big", "x" * 2000, 16))

        record = asyncio.run(run())
    assert record.status == "422"  # beyond the fake model's context window
    assert summarize([record])["failures_by_status"] == {"422": 1}


def test_poison_drill_on_a_fake_stack_restarts_nothing_and_fails_no_innocent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_STEP_DELAY_S", "0.005")  # innocents still run while poison arrives
    out = tmp_path / "poison.json"
    argv = ["--poison", "--model-id", "fake", "--requests", "12", "--concurrency", "4"]
    argv += ["--poison-repeats", "1"]
    argv += ["--log", str(tmp_path / "stack.log"), "--out", str(out)]
    with pytest.raises(SystemExit) as exited:
        fault_drill.main(argv)
    summary = json.loads(out.read_text())
    assert exited.value.code == 0, summary
    assert summary["worker_restarts"] == 0
    assert summary["same_worker_instance"]
    innocent = summary["innocent"]
    assert (innocent["succeeded"], innocent["failed_by_status"], innocent["wrong"]) == (12, {}, 0)
    poison = summary["poison"]
    assert poison["over_limit_body"]["statuses"] == {"413": 2}
    assert poison["not_json"]["statuses"] == {"415": 3}
    assert poison["tiny_temperature"]["statuses"] == {"200": 2}
    assert poison["choices"]["statuses"] == {"422": 3, "400": 1}
    assert poison["most_choices"]["statuses"] == {"200": 1}
    assert poison["grammar"]["statuses"] == {"422": 5}
    assert poison["grammar_served"]["statuses"] == {"200": 1}
    assert {
        kind: tally["unexpected"] for kind, tally in poison.items() if tally["unexpected"]
    } == {}


def test_fault_drill_kills_one_of_two_workers_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_STEP_DELAY_S", "0.03")  # slow enough to outlast a restart
    out = tmp_path / "drill.json"
    argv = ["--model-id", "fake", "--workers", "2", "--frontends", "2", "--kills", "2"]
    argv += ["--stops", "0", "--requests", "40", "--concurrency", "6"]  # on free ports
    argv += ["--log", str(tmp_path / "stack.log"), "--out", str(out)]
    with pytest.raises(SystemExit) as exited:
        fault_drill.main(argv)
    summary = json.loads(out.read_text())
    assert exited.value.code == 0, summary
    assert (summary["succeeded"], summary["lost"], summary["wrong"]) == (40, 0, 0)
    assert (summary["workers"], summary["frontends"]) == (2, 2)
    assert summary["faults"][0]["worst_stall_s"] is not None


def test_a_fault_drill_told_a_taken_port_starts_nothing_and_says_so(tmp_path: Path) -> None:
    """It started its stack anyway, whose supervisor refused the port, and then
    drilled whatever answered there: another stack, or a JSON error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 10  # a worker's port of the stack it would start
        argv = ["--model-id", "fake", "--port", str(port), "--log", str(tmp_path / "logs")]
        with pytest.raises(SystemExit) as exited:
            fault_drill.main(argv)
    assert "is taken: is another stack running there?" in str(exited.value.code)
    assert not (tmp_path / "logs").exists()


def test_fault_drill_against_a_running_stack_waits_for_all_its_workers(tmp_path: Path) -> None:
    overrides = {"NUM_WORKERS": "2", "FAKE_STEP_DELAY_S": "0.03"}
    with running_stack(tmp_path, overrides) as stack:
        stack.wait_for_health("both workers live", lambda h: h["workers_live"] == 2, 30)
        victim = stack.worker_pids()[0]
        out = tmp_path / "drill.json"
        argv = ["--url", stack.url, "--kill-cmd", f"kill -KILL {victim}", "--kills", "1"]
        argv += ["--stops", "0", "--requests", "24", "--concurrency", "6", "--out", str(out)]
        with pytest.raises(SystemExit) as exited:
            fault_drill.main(argv)  # no --workers: the running stack's two
    summary = json.loads(out.read_text())
    assert exited.value.code == 0, summary
    assert summary["workers"] == 2
    assert (summary["succeeded"], summary["lost"], summary["wrong"]) == (24, 0, 0)


def test_fault_drill_at_a_url_faults_that_stacks_workers_and_no_others(tmp_path: Path) -> None:
    (tmp_path / "drilled").mkdir()
    (tmp_path / "bystander").mkdir()
    with (
        running_stack(tmp_path / "drilled", {"NUM_WORKERS": "2"}) as stack,
        running_stack(tmp_path / "bystander", {"NUM_WORKERS": "2"}) as bystander,
    ):
        for each in (stack, bystander):
            each.wait_for_health("both workers live", lambda h: h["workers_live"] == 2, 30)
        args = argparse.Namespace(seed=0, kill_cmd=None, stop_cmd=None)
        injector = fault_drill.FaultInjector(args, started=None, url=stack.url)
        picked = {asyncio.run(injector._worker()).pid for _ in range(20)}
        assert picked <= set(stack.worker_pids()), (picked, bystander.worker_pids())


@pytest.mark.parametrize(
    ("listen_ip", "endpoint", "is_it"),
    [
        ("127.0.0.1", ("127.0.0.1", 5555), True),
        ("0.0.0.0", ("10.0.0.5", 5555), True),  # a wildcard on this host, reached there
        ("0.0.0.0", ("127.0.0.2", 5555), True),  # all of 127/8 is this host's
        ("127.0.0.1", ("172.18.0.2", 5555), False),  # a container's worker: not this one
        ("0.0.0.0", ("172.18.0.2", 5555), False),  # an address this host does not have
        ("127.0.0.1", ("127.0.0.1", 5556), False),
    ],
)
def test_the_fault_drill_takes_a_listener_for_an_endpoint_only_at_its_address(
    listen_ip: str, endpoint: tuple[str, int], is_it: bool
) -> None:
    local = {"127.0.0.1", "10.0.0.5", "::1"}
    assert fault_drill.is_listener_of(listen_ip, 5555, endpoint, local) is is_it


def test_a_bench_stack_finds_its_worker_forked_from_the_fork_server(tmp_path: Path) -> None:
    """With warm starts the worker is the fork server's child, under its own title:
    bench.compare_paths reads its CPU time through `Stack.child`."""
    env = bench_stack.stack_env({"MODEL_ID": "fake"})
    with bench_stack.running_stack(tmp_path, env) as stack:
        stack.wait_live(timeout_s=60)
        worker = stack.child("worker.serve.main")
        assert " ".join(worker.cmdline()).split() == [WORKER_TITLE, env["WORKER_ENDPOINT"]]
        assert "frontend.main" in " ".join(stack.child("frontend.main").cmdline())


def test_path_latency_counts_the_path_not_the_worker(tmp_path: Path) -> None:
    """Five 20 ms steps of the fake worker are the worker's time, not the path's."""
    with running_stack(tmp_path, {"FAKE_STEP_DELAY_S": "0.02"}, supervised=False) as stack:
        stack.wait_live()
        with httpx.Client(timeout=30) as client:
            started = time.perf_counter()
            http_ms = path_latency.http_overhead_ms(client, stack.url, max_new_tokens=5)
            http_total_ms = (time.perf_counter() - started) * 1e3
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        socket = path_latency.connect_worker(context, stack.env["WORKER_ENDPOINT"], None)
        started = time.perf_counter()
        zmq_ms = path_latency.zmq_overhead_ms(socket, max_new_tokens=5)
        zmq_total_ms = (time.perf_counter() - started) * 1e3
        socket.close()
        context.term()
    assert 0 < http_ms < http_total_ms - 80
    assert 0 < zmq_ms < zmq_total_ms - 80


def test_zmq_load_without_a_worker_says_what_it_waits_for_and_why_it_stops(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It waited 60 s in silence, then raised a bare RuntimeError."""
    monkeypatch.setattr(zmq_load, "_HELLO_TIMEOUT_S", 0.5)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as stopped:
        zmq_load.check_worker(endpoint, None)
    assert f"waiting up to 0.5 s for a worker's hello at {endpoint}" in capsys.readouterr().out
    assert str(stopped.value.code).startswith(f"zmq_load: no Hello from a worker at {endpoint}")
    assert "check that the worker is running and bound there" in str(stopped.value.code)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "65526"], "--port must be 1 to 65525, got 65526"),
        (["--port", "0"], "--port must be 1 to 65525, got 0"),
    ],
)
def test_a_fault_drill_told_a_port_out_of_range_starts_nothing(
    argv: list[str], message: str
) -> None:
    """An OverflowError's traceback, or (0) a whole stack that then refused it."""
    with pytest.raises(SystemExit) as exited:
        fault_drill.main(["--model-id", "fake", *argv])
    assert exited.value.code == message


def test_a_fault_drill_with_more_faults_than_room_for_them_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        fault_drill.main(["--model-id", "fake", "--requests", "2"])
    assert exited.value.code == 2
    assert "--requests 2 leave room for 1 faults" in capsys.readouterr().err
