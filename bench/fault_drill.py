"""Fault drill: kill and freeze the worker under load, and prove nothing was lost.

    python -m bench.fault_drill                       # starts its own stack (synthetic model)
    python -m bench.fault_drill --url http://127.0.0.1:8000   # a stack that is running

It sends a seeded workload twice at steady concurrency: once without faults (the
reference answers), then again while it SIGKILLs the worker ``--kills`` times and
SIGSTOPs it once for longer than the liveness timeouts, each at a random point of
progress. Every answer of the second run must equal the first (greedy decoding is
deterministic). Exit status 1 if any request was lost, duplicated or wrong.

For a compose stack, name the fault commands, for example:
    --kill-cmd "docker compose exec -T worker sh -c 'kill -KILL -1'"
    --stop-cmd "docker compose pause worker" --cont-cmd "docker compose unpause worker"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.stack import local_stack as supervised_stack
from bench.stack import stack_env
from bench.workload import make_workload

RESULTS = Path(__file__).parent / "results"
WORKER_MODULES = ("worker.main", "minibatch-worker")


@dataclass
class Fault:
    kind: str  # "kill" or "stop"
    after_completed: int  # injected once this many requests have completed
    injected_at: float = 0.0
    live_again_at: float = 0.0  # /health is 200 again (a new instance, after a kill)
    recovery_s: float | None = None  # injection -> first request completed once live again


@dataclass
class Outcome:
    sent: int = 0
    succeeded: int = 0
    failed_by_status: Counter[int] = field(default_factory=Counter)
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    texts: dict[str, str] = field(default_factory=dict)
    completed_at: list[float] = field(default_factory=list)


class FaultInjector:
    """SIGKILL/SIGSTOP the local worker, or run the user's commands for a remote one."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def _worker(self) -> psutil.Process:
        for process in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            if any(module in cmdline for module in WORKER_MODULES):
                return process
        raise RuntimeError("no local worker process found; pass --kill-cmd/--stop-cmd")

    async def kill(self) -> None:
        if self.args.kill_cmd:
            await _shell(self.args.kill_cmd)
        else:
            self._worker().send_signal(signal.SIGKILL)

    async def stop(self, seconds: float) -> None:
        if self.args.stop_cmd:
            await _shell(self.args.stop_cmd)
            await asyncio.sleep(seconds)
            await _shell(self.args.cont_cmd)
            return
        worker = self._worker()
        worker.send_signal(signal.SIGSTOP)
        # The supervisor kills it once it is declared dead; if not, let it go on.
        with contextlib.suppress(psutil.TimeoutExpired, psutil.NoSuchProcess):
            worker.wait(timeout=seconds)
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signal.SIGCONT)


async def _shell(command: str) -> None:
    process = await asyncio.create_subprocess_shell(command)
    if await process.wait() != 0:
        raise RuntimeError(f"fault command failed: {command}")


async def run_load(
    url: str,
    bodies: list[dict[str, object]],
    concurrency: int,
    timeout_s: float,
    faults: list[Fault] | None = None,
    injector: FaultInjector | None = None,
    stop_s: float = 0.0,
) -> Outcome:
    outcome = Outcome()
    queue: asyncio.Queue[dict[str, object]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    progress = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            outcome.sent += 1
            try:
                response = await client.post("/generate", json=body, timeout=timeout_s)
            except httpx.TimeoutException:
                outcome.lost += 1
                continue
            except httpx.TransportError:
                outcome.failed_by_status[0] += 1  # connection refused/reset: no status
                continue
            outcome.completed_at.append(time.monotonic())
            progress.set()
            if response.status_code != 200:
                outcome.failed_by_status[response.status_code] += 1
                continue
            answer = response.json()
            request_id = str(answer["request_id"])
            if request_id != body["request_id"] or request_id in outcome.texts:
                outcome.duplicated += 1
                continue
            outcome.succeeded += 1
            outcome.texts[request_id] = str(answer["text"])

    async def inject_faults() -> None:
        assert faults is not None and injector is not None
        for fault in faults:
            while len(outcome.completed_at) < fault.after_completed:
                progress.clear()
                await progress.wait()
            before = await _instance(url)
            fault.injected_at = time.monotonic()
            print(f"  fault: {fault.kind} after {fault.after_completed} completed", flush=True)
            if fault.kind == "kill":
                await injector.kill()
                await _wait_live(url, timeout_s, instance_not=before)
            else:
                await injector.stop(stop_s)
                await _wait_live(url, timeout_s)
            fault.live_again_at = time.monotonic()
            # The next fault waits for recovery: a request completed on the live worker.
            while not outcome.completed_at or outcome.completed_at[-1] < fault.live_again_at:
                progress.clear()
                await progress.wait()

    async with httpx.AsyncClient(base_url=url) as client:
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(concurrency)]
        if faults:
            tasks.append(asyncio.create_task(inject_faults()))
        await asyncio.gather(*tasks)
    for fault in faults or []:
        after = [t for t in outcome.completed_at if t >= fault.live_again_at]
        fault.recovery_s = min(after) - fault.injected_at if after else None
    return outcome


async def _instance(url: str) -> str | None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        return (await client.get("/health")).json().get("instance_id")  # type: ignore[no-any-return]


async def _wait_live(url: str, timeout_s: float, instance_not: str | None = None) -> None:
    """Until /health is 200, from a worker other than ``instance_not``."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                response = await client.get("/health")
                is_other = response.json().get("instance_id") != instance_not
                if response.status_code == 200 and (instance_not is None or is_other):
                    return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the stack at {url} did not become healthy within {timeout_s} s")


def plan_faults(num_kills: int, num_requests: int, seed: int) -> list[Fault]:
    """Kills and one stop at random, distinct points between 5% and 85% of progress."""
    rng = random.Random(seed)
    low, high = max(1, num_requests // 20), max(2, num_requests * 85 // 100)
    points = sorted(rng.sample(range(low, high), num_kills + 1))
    kinds = ["kill"] * num_kills + ["stop"]
    rng.shuffle(kinds)
    return [Fault(kind, point) for kind, point in zip(kinds, points, strict=True)]


@contextlib.contextmanager
def local_stack(args: argparse.Namespace) -> Iterator[str]:
    """Start the supervisor with drill-friendly liveness timeouts; yield its URL."""
    env = stack_env(
        {
            "MODEL_ID": args.model_id,
            "PORT": str(args.port),
            "WORKER_ENDPOINT": f"tcp://127.0.0.1:{args.port + 1}",
            "HEARTBEAT_TIMEOUT_S": os.environ.get("HEARTBEAT_TIMEOUT_S", "2"),
            "STEP_TIMEOUT_S": os.environ.get("STEP_TIMEOUT_S", "10"),
            "FRONTEND_TIMEOUT_S": os.environ.get("FRONTEND_TIMEOUT_S", "5"),
        }
    )
    with supervised_stack(env, Path(args.log)) as stack:
        yield stack.url


def report(
    reference: Outcome, drill: Outcome, faults: list[Fault], wall_s: float
) -> dict[str, object]:
    drill.wrong = sum(
        1 for rid, text in drill.texts.items() if reference.texts.get(rid) not in (None, text)
    )
    failed = sum(drill.failed_by_status.values())
    rows = [
        ("requests sent", drill.sent),
        ("succeeded", drill.succeeded),
        ("failed", failed),
        *(
            (f"  failed with HTTP {code or 'none'}", n)
            for code, n in drill.failed_by_status.items()
        ),
        ("lost (no answer by the deadline)", drill.lost),
        ("duplicated", drill.duplicated),
        ("wrong text", drill.wrong),
    ]
    print(f"\nfault drill: {len(faults)} faults in {wall_s:.1f} s")
    for name, value in rows:
        print(f"  {name:<34} {value:>6}")
    print("\n  fault  after request  recovery (fault -> first request completed by a live worker)")
    for fault in faults:
        recovery = f"{fault.recovery_s:.2f} s" if fault.recovery_s is not None else "never"
        print(f"  {fault.kind:<5}  {fault.after_completed:>13}  {recovery}")
    return {
        "sent": drill.sent,
        "succeeded": drill.succeeded,
        "failed_by_status": {str(k): v for k, v in drill.failed_by_status.items()},
        "lost": drill.lost,
        "duplicated": drill.duplicated,
        "wrong": drill.wrong,
        "faults": [asdict(f) for f in faults],
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running stack; default: start one here")
    parser.add_argument("--model-id", default="synthetic", help="for the stack it starts")
    parser.add_argument("--port", type=int, default=8400, help="for the stack it starts")
    parser.add_argument(
        "--log", default=str(RESULTS / "fault_drill_stack.log"), help="the started stack's log"
    )
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs of the worker")
    parser.add_argument("--stop-s", type=float, default=4.0, help="how long SIGSTOP lasts")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-cmd", help="shell command that SIGKILLs the worker")
    parser.add_argument("--stop-cmd", help="shell command that freezes the worker")
    parser.add_argument("--cont-cmd", help="shell command that thaws it")
    args = parser.parse_args(argv)
    if bool(args.stop_cmd) != bool(args.cont_cmd):
        parser.error("--stop-cmd and --cont-cmd go together")

    bodies = [
        {"request_id": r.request_id, "prompt": r.prompt, "max_new_tokens": r.max_new_tokens}
        for r in make_workload(args.requests, seed=args.seed)
    ]
    faults = plan_faults(args.kills, len(bodies), args.seed)
    stack = contextlib.nullcontext(args.url) if args.url else local_stack(args)
    with stack as url:
        asyncio.run(_wait_live(url, 300))
        print(f"reference run: {len(bodies)} requests, concurrency {args.concurrency}", flush=True)
        reference = asyncio.run(run_load(url, bodies, args.concurrency, args.timeout_s))
        if reference.succeeded != len(bodies):
            sys.exit(f"the reference run itself failed: {reference.failed_by_status}")
        print("drill run, with faults:", flush=True)
        started = time.monotonic()
        drill = asyncio.run(
            run_load(
                url,
                bodies,
                args.concurrency,
                args.timeout_s,
                faults,
                FaultInjector(args),
                args.stop_s,
            )
        )
        summary = report(reference, drill, faults, time.monotonic() - started)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fault_drill.json").write_text(json.dumps(summary, indent=2) + "\n")
    bad = drill.lost + drill.duplicated + drill.wrong + sum(drill.failed_by_status.values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
