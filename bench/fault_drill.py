"""Fault drill: kill and freeze workers under load, and prove nothing was lost.

    python -m bench.fault_drill                       # starts its own stack (synthetic model)
    python -m bench.fault_drill --workers 2 --frontends 2 --stops 0   # kill one of two
    python -m bench.fault_drill --url http://127.0.0.1:8000   # a stack that is running

It sends a seeded workload twice at steady concurrency: once without faults (the
reference answers and latencies), then again while it SIGKILLs a worker
``--kills`` times and SIGSTOPs one ``--stops`` times for longer than the liveness
timeouts, each at a random point of progress. Every answer of the second run
must equal the first (greedy decoding is deterministic; with ``--sampled``, each
request samples with a seed of its own, and a resumed stream must continue as
its fault-free run did: "wrong text" counts the streams that differ). Requests
are streamed.
For each fault it reports what it cost the requests in flight at that moment:
the longest pause in one's token stream across the fault, and their latency
minus the same request's in the reference run (which also carries the
run-to-run noise, shown beside for the requests no fault caught). Each fault waits until
every request the one before it caught has been answered and every worker is
live again. With several frontends, requests go to each in turn. Exit status 1
if any request was lost, duplicated, failed or wrong.

    python -m bench.fault_drill --poison              # poison requests instead of faults

With ``--poison`` the second run injects no faults: poison requests (see
`bench.poison`) are sent alongside the workload instead, each must get the answer
a sound server gives it, no worker may restart, and no innocent answer may change.

For a compose stack, name the fault commands, for example:
    --kill-cmd "docker compose exec -T worker sh -c 'kill -KILL -1'"
    --stop-cmd "docker compose pause worker" --cont-cmd "docker compose unpause worker"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import os
import random
import signal
import socket
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import psutil

from bench.load_run import LoadRun, Outcome, check_answers, health, stall_across
from bench.poison_drill import poison_drill
from bench.report import RESULTS, write_json
from bench.stack import Stack, are_free, first_of_free_ports, running_stack, stack_env
from bench.workload import make_workload
from frontend.config import FrontendConfig
from protocol.endpoints import MAX_PORT, TcpEndpoint

WORKER_MODULES = ("worker.serve.main", "minibatch-worker")


@dataclass
class Fault:
    kind: str  # "kill" or "stop"
    after_completed: int  # injected once this many requests have completed
    injected_at: float = 0.0  # 0: never injected, the workload ended first
    num_completed: int = 0  # at injection: later than planned while the last one's catch ran
    num_in_flight: int = 0  # requests sent and not yet answered at the fault
    live_again_at: float = 0.0  # every worker live again (a new instance, after a kill)
    recovery_s: float | None = None  # injection -> first request completed once live again
    caught: list[str] = field(default_factory=list)  # the requests in flight at the fault
    # The longest pause in the token stream of one of them, across the fault.
    worst_stall_s: float | None = None
    # Their latency minus the same request's in the fault-free run: the most, the median.
    worst_added_s: float | None = None
    median_added_s: float | None = None


class FaultInjector:
    """SIGKILL/SIGSTOP a local worker of the stack under test, or run the user's
    commands for a remote one. Other stacks may be running on this machine: only
    the workers of ``started`` (the stack the drill started) are faulted, or
    without one, the workers listening on the endpoints that ``url``'s /health
    names."""

    def __init__(self, args: argparse.Namespace, started: Stack | None, url: str) -> None:
        self.args = args
        self.started = started
        self.url = url
        self.rng = random.Random(args.seed)

    async def _worker(self) -> psutil.Process:
        """One of the stack's local workers, at random."""
        if self.started is None:
            listed = cast("list[dict[str, Any]]", (await health(self.url))["workers"])
            endpoints = _addresses(str(worker["endpoint"]) for worker in listed)
            local = _local_addresses()
            processes = [
                process for process in psutil.process_iter() if _listens(process, endpoints, local)
            ]
        else:
            supervisor = self.started.processes["supervisor"].pid
            processes = psutil.Process(supervisor).children(recursive=True)
        workers = []
        for process in processes:
            with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
                if any(module in " ".join(process.cmdline()) for module in WORKER_MODULES):
                    workers.append(process)
        if not workers:
            raise RuntimeError(
                f"no worker of {self.url} listens on this host (one in a container or "
                "elsewhere is out of reach): pass --kill-cmd, --stop-cmd and --cont-cmd"
            )
        return self.rng.choice(sorted(workers, key=lambda process: process.pid))

    async def kill(self) -> None:
        if self.args.kill_cmd:
            await _shell(self.args.kill_cmd)
        else:
            (await self._worker()).send_signal(signal.SIGKILL)

    async def stop(self, seconds: float) -> None:
        if self.args.stop_cmd:
            await _shell(self.args.stop_cmd)
            await asyncio.sleep(seconds)
            await _shell(self.args.cont_cmd)
            return
        worker = await self._worker()
        worker.send_signal(signal.SIGSTOP)
        # The supervisor kills it once it is declared dead; if not, let it go on.
        with contextlib.suppress(psutil.TimeoutExpired, psutil.NoSuchProcess):
            worker.wait(timeout=seconds)
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signal.SIGCONT)


def _addresses(endpoints: Iterable[str]) -> set[tuple[str, int]]:
    """(IP, port) of each tcp:// endpoint, its host looked up."""
    addresses = set()
    for endpoint in endpoints:
        tcp = TcpEndpoint.parse(endpoint)
        if tcp is None or not tcp.host:
            continue
        with contextlib.suppress(OSError):
            for *_, sockaddr in socket.getaddrinfo(tcp.host, tcp.port):
                addresses.add((str(sockaddr[0]), tcp.port))
    return addresses


def _local_addresses() -> set[str]:
    """This host's own IP addresses: where a wildcard listener is reached."""
    return {
        address.address.split("%")[0]
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family in (socket.AF_INET, socket.AF_INET6)
    }


def is_listener_of(
    listen_ip: str, listen_port: int, endpoint: tuple[str, int], local: set[str]
) -> bool:
    """Whether a socket listening at ``listen_ip:listen_port`` is what ``endpoint``
    reaches: the same port, and the same address or a wildcard one on this host.
    A worker in a container (another network namespace) is at an address this host
    does not have, so a worker here on the same port is not taken for it."""
    ip, port = endpoint
    if listen_port != port:
        return False
    # Every loopback address is this host's, though an interface lists one.
    is_here = ip in local or ipaddress.ip_address(ip.split("%")[0]).is_loopback
    return listen_ip == ip or (listen_ip in ("0.0.0.0", "::") and is_here)


def _listens(process: psutil.Process, endpoints: set[tuple[str, int]], local: set[str]) -> bool:
    """Whether ``process`` listens (TCP) where one of ``endpoints`` reaches."""
    with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
        return any(
            connection.status == psutil.CONN_LISTEN
            and is_listener_of(connection.laddr.ip, connection.laddr.port, endpoint, local)
            for connection in process.net_connections(kind="tcp")
            for endpoint in endpoints
        )
    return False


async def _shell(command: str) -> None:
    process = await asyncio.create_subprocess_shell(command)
    if await process.wait() != 0:
        raise RuntimeError(f"fault command failed: {command}")


async def inject_faults(
    run: LoadRun, faults: list[Fault], injector: FaultInjector, stop_s: float, num_workers: int
) -> None:
    for fault in faults:
        if not await run.wait_for_num_completed(fault.after_completed):
            return  # the workload ended first: the fault stays not injected
        before = await _live_instances(run.url)
        caught = set(run.in_flight)
        fault.caught = sorted(caught)
        fault.num_completed = len(run.outcome.completed_at)
        fault.num_in_flight = len(caught)
        fault.injected_at = time.monotonic()
        print(f"  fault: {fault.kind} after {fault.after_completed} completed", flush=True)
        if fault.kind == "kill":
            await injector.kill()
            await _wait_whole(run.url, num_workers, run.timeout_s, before, injector.started)
        else:
            await injector.stop(stop_s)
            await _wait_whole(run.url, num_workers, run.timeout_s, started=injector.started)
        fault.live_again_at = time.monotonic()
        # The next fault waits until every request this one caught has its answer:
        # a request in flight on two workers that died is failed, not replayed again.
        await run.wait_for_answers(caught)


async def _live_instances(url: str) -> set[str]:
    workers = (await health(url)).get("workers") or []
    return {str(w["instance_id"]) for w in workers if w["state"] == "live"}  # type: ignore[attr-defined]


async def _wait_whole(
    url: str,
    num_workers: int,
    timeout_s: float,
    replacing: set[str] | None = None,
    started: Stack | None = None,
) -> None:
    """Until /health counts ``num_workers`` live workers, not all of ``replacing``.
    Ends the drill if ``started``, the stack it started, has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if started is not None and (code := started.processes["supervisor"].poll()) is not None:
            last_lines = "\n".join(started.log("supervisor").splitlines()[-5:])
            sys.exit(f"the stack this drill started exited ({code}); its log ends:\n{last_lines}")
        with contextlib.suppress(httpx.TransportError):
            live = await _live_instances(url)
            if len(live) >= num_workers and (replacing is None or live != replacing):
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{num_workers} workers at {url} were not live within {timeout_s} s")


def fault_points(num_requests: int) -> range:
    """Where a fault may fall: between 5% and 85% of the requests answered."""
    return range(max(1, num_requests // 20), max(2, num_requests * 85 // 100))


def plan_faults(num_kills: int, num_stops: int, num_requests: int, seed: int) -> list[Fault]:
    """Kills and stops at random, distinct points between 5% and 85% of progress."""
    rng = random.Random(seed)
    points = sorted(rng.sample(fault_points(num_requests), num_kills + num_stops))
    kinds = ["kill"] * num_kills + ["stop"] * num_stops
    rng.shuffle(kinds)
    return [Fault(kind, point) for kind, point in zip(kinds, points, strict=True)]


def _stack_ports(port: int | None, num_frontends: int, num_workers: int) -> int:
    """The first frontend's port: ``port``, if it and the ports after it that the
    stack takes are free, else the drill ends saying so; free ports if None."""
    if port is None:
        return first_of_free_ports(10 + num_workers)
    highest = MAX_PORT - 9 - num_workers  # its last worker's port is port + 9 + num_workers
    if not 1 <= port <= highest:
        sys.exit(f"--port must be 1 to {highest}, got {port}")
    taken = [*range(port, port + num_frontends), *range(port + 10, port + 10 + num_workers)]
    if not are_free(taken):
        sys.exit(
            f"a port of {port} to {port + num_frontends - 1} (frontends) or {port + 10} to "
            f"{port + 9 + num_workers} (workers) is taken: is another stack running there? "
            "Pass another --port, or none for free ports; to drill a running stack, --url"
        )
    return port


@contextlib.contextmanager
def local_stack(args: argparse.Namespace) -> Iterator[Stack]:
    """Start the supervisor with drill-friendly liveness timeouts."""
    env = stack_env(
        {
            "MODEL_ID": args.model_id,
            "NUM_WORKERS": str(args.workers),
            "NUM_FRONTENDS": str(args.frontends),
            # Frontends listen on the port and the ones after it; workers above them.
            "PORT": str(args.port),
            "WORKER_ENDPOINT": f"tcp://127.0.0.1:{args.port + 10}",
            "HEARTBEAT_TIMEOUT_S": os.environ.get("HEARTBEAT_TIMEOUT_S", "2"),
            "STEP_TIMEOUT_S": os.environ.get("STEP_TIMEOUT_S", "10"),
            "FRONTEND_TIMEOUT_S": os.environ.get("FRONTEND_TIMEOUT_S", "5"),
        }
    )
    with running_stack(Path(args.log), env) as stack:
        yield stack


def kill_drill(
    urls: list[str],
    bodies: list[dict[str, object]],
    reference: Outcome,
    args: argparse.Namespace,
    stack: Stack | None,
) -> tuple[dict[str, object], bool]:
    """The second run with faults; its summary, and whether anything went wrong."""
    faults = plan_faults(args.kills, args.stops, len(bodies), args.seed)
    print("drill run, with faults:", flush=True)
    started = time.monotonic()
    run = LoadRun(urls, bodies, args.concurrency, args.timeout_s)
    injector = FaultInjector(args, stack, urls[0])
    drill = asyncio.run(
        run.run(lambda run: inject_faults(run, faults, injector, args.stop_s, args.workers))
    )
    wall_s = time.monotonic() - started
    added = {
        rid: drill.latency_s[rid] - reference.latency_s[rid]
        for rid in drill.latency_s.keys() & reference.latency_s.keys()
    }
    for fault in faults:
        after = [t for t in drill.completed_at if t >= fault.live_again_at > 0]
        fault.recovery_s = min(after) - fault.injected_at if after else None
        caught = [added[rid] for rid in fault.caught if rid in added]
        if caught:
            fault.worst_added_s = max(caught)
            fault.median_added_s = statistics.median(caught)
        stalls = [
            stall
            for rid in fault.caught
            if (stall := stall_across(drill.token_times.get(rid, []), fault.injected_at))
        ]
        fault.worst_stall_s = max(stalls, default=None)
    num_injected = sum(1 for fault in faults if fault.injected_at)
    print(
        f"\nfault drill: {num_injected} faults in {wall_s:.1f} s, {args.workers} workers, "
        f"{len(urls)} frontends"
    )
    summary, num_bad = check_answers(reference, drill)
    print(
        "\n  fault  planned after  injected after  in flight  longest pause  "
        "e2e added: worst / median  all workers live after"
    )
    for fault in faults:
        planned = f"  {fault.kind:<5}  {fault.after_completed:>13}"
        if not fault.injected_at:
            print(f"{planned}  not injected: the workload ended first")
            continue
        worst, median = _seconds(fault.worst_added_s), _seconds(fault.median_added_s)
        pause = _seconds(fault.worst_stall_s).lstrip("+")
        whole = fault.live_again_at - fault.injected_at
        print(
            f"{planned}  {fault.num_completed:>14}  {fault.num_in_flight:>9}  {pause:>13}  "
            f"{worst:>10} / {median:<13}  {whole:.2f} s"
        )
    all_caught = {rid for fault in faults for rid in fault.caught}
    spared = [value for rid, value in added.items() if rid not in all_caught]
    spared_pauses = [
        max(b - a for a, b in itertools.pairwise(times))
        for rid, times in drill.token_times.items()
        if rid not in all_caught and len(times) > 1
    ]
    if spared:
        print(
            f"  requests no fault caught (the noise): longest pause {max(spared_pauses):.2f} s, "
            f"e2e added worst {max(spared):+.2f} s, median {statistics.median(spared):+.2f} s"
        )
    if num_injected < len(faults):
        print("  some faults came too late for the workload: give more --requests")
    idle = sum(1 for fault in faults if fault.injected_at and not fault.num_in_flight)
    if idle:
        print(
            f"  {idle} of {num_injected} faults caught no request in flight, and tested "
            "nothing: give more --requests, or a slower engine"
        )
    summary |= {
        "workers": args.workers,
        "frontends": len(urls),
        "faults": [asdict(f) for f in faults],
        "spared_longest_pause_s": max(spared_pauses, default=None),
        "spared_worst_added_s": max(spared, default=None),
        "spared_median_added_s": statistics.median(spared) if spared else None,
        "wall_s": wall_s,
    }
    return summary, num_bad > 0 or num_injected < len(faults)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", nargs="+", help="a running stack's frontends; default: start a stack here"
    )
    parser.add_argument(
        "--model-id", default="synthetic", help="for the stack it starts (default %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=int,
        help="the started stack's first frontend (default: a free port); its workers bind "
        "port + 10 and the ports after it",
    )
    parser.add_argument(
        "--log",
        default=str(RESULTS / "fault_drill_stack"),
        help="the started stack's log folder (default %(default)s)",
    )
    parser.add_argument(
        "--out", help="the results file (default: bench/results/fault_drill[_poison].json)"
    )
    parser.add_argument(
        "--kills", type=int, default=5, help="SIGKILLs of a worker (default %(default)s)"
    )
    parser.add_argument(
        "--stops", type=int, default=1, help="SIGSTOPs of a worker (default %(default)s)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="workers in the stack: NUM_WORKERS of one it starts (default 1); of a running "
        "one (--url), by default those live at the start",
    )
    parser.add_argument(
        "--frontends",
        type=int,
        default=1,
        help="NUM_FRONTENDS of the stack it starts (default %(default)s)",
    )
    parser.add_argument(
        "--stop-s", type=float, default=4.0, help="how long SIGSTOP lasts (default %(default)s)"
    )
    parser.add_argument(
        "--requests", type=int, default=120, help="in each of the two runs (default %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests in flight at once (default %(default)s)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="per request (default %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="of the workload and the faults (default %(default)s)"
    )
    parser.add_argument(
        "--sampled",
        action="store_true",
        help="sample (temperature 0.9, top_p 0.95) with a seed per request, instead of greedy",
    )
    parser.add_argument("--kill-cmd", help="shell command that SIGKILLs the worker")
    parser.add_argument("--stop-cmd", help="shell command that freezes the worker")
    parser.add_argument("--cont-cmd", help="shell command that thaws it")
    parser.add_argument(
        "--poison", action="store_true", help="mix in poison requests instead of faults"
    )
    parser.add_argument(
        "--poison-repeats", type=int, default=3, help="sends of each poison (default %(default)s)"
    )
    parser.add_argument(
        "--vocab-size", type=int, help="the served model's (default: by the model /health names)"
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=FrontendConfig.max_request_bytes,
        help="the stack's MAX_REQUEST_BYTES (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if bool(args.stop_cmd) != bool(args.cont_cmd):
        parser.error("--stop-cmd and --cont-cmd go together")
    num_points = len(fault_points(args.requests))
    if not args.poison and args.kills + args.stops > num_points:
        parser.error(
            f"--requests {args.requests} leave room for {num_points} faults, one per point "
            f"of progress; --kills and --stops ask for {args.kills + args.stops}"
        )

    bodies: list[dict[str, object]] = [
        {"request_id": r.request_id, "prompt": r.prompt, "max_new_tokens": r.max_new_tokens}
        for r in make_workload(args.requests, seed=args.seed)
    ]
    if args.sampled:
        for i, body in enumerate(bodies):
            body.update(temperature=0.9, top_p=0.95, seed=args.seed * 100_003 + i)
    if args.workers is None and not args.url:
        args.workers = 1
    if not args.url:
        args.port = _stack_ports(args.port, args.frontends, args.workers)
    with contextlib.ExitStack() as exits:
        local = None if args.url else exits.enter_context(local_stack(args))
        urls = args.url or [f"http://127.0.0.1:{args.port + i}" for i in range(args.frontends)]
        if args.workers is None:  # a running stack: all its workers must be back after each fault
            args.workers = max(1, len(asyncio.run(_live_instances(urls[0]))))
        for url in urls:
            asyncio.run(_wait_whole(url, args.workers, 300, started=local))
        # A worker's first requests pay for its warm-up (allocations, kernels'
        # first calls): in the reference alone, they made a fault look free.
        warm_up = bodies[: args.concurrency]
        asyncio.run(LoadRun(urls, warm_up, args.concurrency, args.timeout_s).run())
        print(f"reference run: {len(bodies)} requests, concurrency {args.concurrency}", flush=True)
        reference = asyncio.run(LoadRun(urls, bodies, args.concurrency, args.timeout_s).run())
        if reference.succeeded != len(bodies):
            sys.exit(f"the reference run itself failed: {reference.failed_by_status}")
        if args.poison:
            summary, is_bad = poison_drill(urls[0], bodies, reference, args)
        else:
            summary, is_bad = kill_drill(urls, bodies, reference, args, local)
    name = "fault_drill_poison.json" if args.poison else "fault_drill.json"
    out = Path(args.out) if args.out else RESULTS / name
    write_json(out, summary)
    sys.exit(1 if is_bad else 0)


if __name__ == "__main__":
    main()
