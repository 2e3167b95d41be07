"""The poison drill: poison requests (`bench.poison`) sent alongside the workload,
each of which must get the answer a sound server gives it, while no worker
restarts and no innocent answer changes."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable

from bench.load_run import LoadRun, Outcome, check_answers, health
from bench.poison import KindTally, make_probes, print_tallies, send_mixed_in, vocab_size_of


def poison_drill(
    url: str, bodies: list[dict[str, object]], reference: Outcome, args: argparse.Namespace
) -> tuple[dict[str, object], bool]:
    """The second run with poison mixed in and no faults, so that any restart is
    the poison's doing; its summary, and whether a target was missed."""
    before = asyncio.run(health(url))
    model = str(before["model"])
    probes = make_probes(
        bodies,
        reference.texts,
        model,
        args.vocab_size or vocab_size_of(model),
        args.max_request_bytes,
    )
    probes *= args.poison_repeats
    print(f"drill run, with {len(probes)} poison requests mixed in:", flush=True)
    tallies: dict[str, KindTally] = {}

    async def mix_in(run: LoadRun) -> None:
        # Spread evenly over the workload: probe i once i/len(probes) of it is answered.
        def wait_turn(i: int) -> Awaitable[bool]:
            return run.wait_for_num_completed(i * len(bodies) // len(probes))

        tallies.update(await send_mixed_in(url, probes, args.timeout_s, wait_turn))

    started = time.monotonic()
    drill = asyncio.run(LoadRun([url], bodies, args.concurrency, args.timeout_s).run(mix_in))
    wall_s = time.monotonic() - started
    after = asyncio.run(health(url))
    num_restarts = int(str(after["worker_restarts"])) - int(str(before["worker_restarts"]))
    is_same_worker = after["instance_id"] == before["instance_id"]
    num_under_load = sum(t.num_sent_under_load for t in tallies.values())
    print(f"\npoison drill: {len(probes)} poison requests in {wall_s:.1f} s")
    print(f"  {'worker restarts':<34} {num_restarts:>6}")
    print(f"  {'same worker instance after':<34} {'yes' if is_same_worker else 'NO':>6}")
    print(f"  {'poison sent while innocents ran':<34} {num_under_load:>6}")
    print("  innocent requests:")
    innocent, num_bad = check_answers(reference, drill)
    print_tallies(tallies)
    num_unexpected = sum(t.num_unexpected for t in tallies.values())
    summary: dict[str, object] = {
        "worker_restarts": num_restarts,
        "same_worker_instance": is_same_worker,
        "innocent": innocent,
        "poison_sent": len(probes),
        "poison_sent_while_innocents_ran": num_under_load,
        "poison": {kind: tally.summary() for kind, tally in tallies.items()},
        "wall_s": wall_s,
    }
    is_bad = num_restarts > 0 or not is_same_worker or num_bad > 0 or num_unexpected > 0
    return summary, is_bad
