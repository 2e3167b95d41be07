"""This server against llama.cpp's llama-server on the same weights, over HTTP.

    python -m bench.llama_compare                  # P = 8 and 32 slots, 2 rounds
    python -m bench.llama_compare --slots 8 --requests 8 --rounds 1 \\
        --engines ours-float32 llama-f32 --out /tmp/llama_smoke.json

Both servers get the same seeded workload (prompts of 8 to 64 words, 8 to 48
output tokens with EOS ignored, so that both produce exactly as many) over
``/v1/completions``, streamed, from a closed loop of P users against P slots.
This server runs the synthetic model (MODEL_ID=synthetic, MAX_BATCH_SIZE=P) in
float32, DTYPE=float16 and WEIGHTS=int8; llama-server (``--parallel P``, ``-c``
P x 1024, ``--cont-batching``, a thread per core, no prompt cache) runs the same
weights converted to f32, f16 and Q8_0 GGUF. Build it and convert the model as
docs/performance.md says ("Against llama.cpp's server"); LLAMA_SERVER (or
``--llama-server``) names the binary and LLAMA_GGUF_DIR (or ``--gguf-dir``) the
folder of ``synthetic-<f32|f16|q8_0>.gguf``.

Each run starts its server afresh and warms it on other prompts; the engines
take turns, round after round. Every answer must carry exactly its budget of
output tokens, and each prompt the same number of tokens on every engine, or
the run stops. Prints tokens/s and latency per engine (the median over rounds)
and the ratios of this server to llama-server; writes
bench/results/llama_compare.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import load
from bench.http_client import OPENAI
from bench.http_load import run_http
from bench.report import (
    RESULTS,
    RequestRecord,
    describe_machine,
    machine,
    median_summary,
    summarize,
    table,
    write_json,
)
from bench.stack import free_port, running_stack, stack_env
from bench.workload import MAX_NEW_TOKENS_CHOICES
from protocol import GenerateRequest

LLAMA_CPP_DIR = Path.home() / ".cache" / "minibatch-llm" / "llama.cpp"
HOW_TO_BUILD = 'docs/performance.md, "Against llama.cpp\'s server"'
PROMPT_WORDS = (8, 64)
CONTEXT_PER_SLOT = 1024  # the model's context window
# This server's modes and llama-server's GGUF types; ENGINES pairs them by what
# they store, in the order the runs take turns.
OURS = {
    "ours-float32": {"DTYPE": "float32", "WEIGHTS": ""},
    "ours-float16": {"DTYPE": "float16", "WEIGHTS": ""},
    "ours-int8": {"DTYPE": "float32", "WEIGHTS": "int8"},
}
LLAMA = {"llama-f32": "f32", "llama-f16": "f16", "llama-q8_0": "q8_0"}
ENGINES = ("ours-float32", "llama-f32", "ours-float16", "llama-f16", "ours-int8", "llama-q8_0")
# The targets: this server's tokens/s over llama-server's, at no higher p95.
TARGETS = {"llama-f16": 1.5, "llama-q8_0": 1.2}


def num_requests(slots: int) -> int:
    return max(64, 4 * slots)  # 64 at 8 slots, 128 at 32


def load_args(args: argparse.Namespace, slots: int, requests: int, seed: int) -> argparse.Namespace:
    """What bench.load and bench.http_load's client read: a closed loop of ``slots``
    users, streamed OpenAI completions with EOS ignored."""
    return argparse.Namespace(
        requests=requests,
        seed=seed,
        prompt_words=PROMPT_WORDS,
        max_new_tokens=list(MAX_NEW_TOKENS_CHOICES),
        mode="closed",
        concurrency=slots,
        no_progress=True,
        api=OPENAI,
        model=None,  # the first one /v1/models lists
        no_stream=False,
        no_ignore_eos=False,
        timeout_s=args.timeout_s,
    )


@contextmanager
def serving(engine: str, slots: int, args: argparse.Namespace) -> Iterator[str]:
    """The engine's server, started afresh on free ports: its URL while it runs."""
    env = stack_env()
    logs = RESULTS / "llama_compare_stack" / f"{engine}_{slots}"
    if engine in OURS:
        env.update(MODEL_ID="synthetic", MAX_BATCH_SIZE=str(slots), **OURS[engine])
        with running_stack(logs, env) as stack:
            stack.wait_live(timeout_s=300)
            yield stack.url
        return
    command = [
        str(args.llama_server),
        *("--model", str(gguf_path(args, engine))),
        *("--host", "127.0.0.1", "--port", env["PORT"]),
        *("--parallel", str(slots), "--ctx-size", str(slots * CONTEXT_PER_SLOT)),
        "--cont-batching",
        *("--threads", str(len(os.sched_getaffinity(0)))),
        # Distinct prompts and a fresh server per run already leave nothing to reuse.
        *("--no-cache-prompt", "--cache-ram", "0"),
        "--no-webui",
    ]
    with running_stack(logs, env, supervised=False, start=()) as stack:
        stack.start_command("llama-server", command, env)
        stack.wait_for_health("llama-server live", lambda h: h.get("status") == "ok", 120)
        yield stack.url


def gguf_path(args: argparse.Namespace, engine: str) -> Path:
    return Path(args.gguf_dir) / f"synthetic-{LLAMA[engine]}.gguf"


def run_once(
    engine: str, slots: int, args: argparse.Namespace
) -> tuple[list[RequestRecord], list[int]]:
    """One run: a fresh server, a warm-up of one request per slot on other prompts,
    then the workload; its records and the prompt lengths the server counted."""
    warm_up = load_args(args, slots, slots, args.seed + 1)
    measured = load_args(args, slots, args.requests or num_requests(slots), args.seed)
    requests = load.tagged_workload(measured, tag=f"{engine}-{uuid.uuid4().hex[:8]}")
    with serving(engine, slots, args) as url:
        asyncio.run(run_http(url, load.tagged_workload(warm_up, tag=f"warm-{engine}"), warm_up))
        records = asyncio.run(run_http(url, requests, measured))
    return records, check_tokens(engine, requests, records)


def check_tokens(
    engine: str, requests: Sequence[GenerateRequest], records: Sequence[RequestRecord]
) -> list[int]:
    """Stop unless every request succeeded with exactly its budget of output tokens
    and its answer said how many prompt tokens the server read; those counts, in
    the workload's order."""
    by_id = {r.request_id: r for r in records}
    wrong = [
        f"{request.request_id}: "
        + (
            f"{record.status}, {record.num_tokens} of {request.max_new_tokens} output tokens, "
            f"{record.num_prompt_tokens} prompt tokens"
            if record
            else "no answer"
        )
        for request in requests
        if (record := by_id.get(request.request_id)) is None
        or not record.is_ok
        or record.num_tokens != request.max_new_tokens
        or record.num_prompt_tokens is None
    ]
    if wrong:
        raise SystemExit(
            f"{engine}: {len(wrong)} of {len(requests)} requests did not end with exactly their "
            "output tokens and a prompt token count, so its numbers would not compare: "
            + "; ".join(wrong[:5])
        )
    return [int(by_id[request.request_id].num_prompt_tokens or 0) for request in requests]


def ratios(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each of this server's modes over each llama-server type: tokens/s and e2e p95."""
    return {
        ours: {
            llama: {
                "tokens_per_s": summaries[ours]["tokens_per_s"] / summaries[llama]["tokens_per_s"],
                "e2e_p95": summaries[ours]["e2e_ms"]["p95"] / summaries[llama]["e2e_ms"]["p95"],
            }
            for llama in summaries
            if llama in LLAMA
        }
        for ours in summaries
        if ours in OURS
    }


def targets(pairs: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, list[str]]:
    """For each target, the modes of this server that meet it."""
    return {
        llama: [
            ours
            for ours, against in pairs.items()
            if against[llama]["tokens_per_s"] >= wanted and against[llama]["e2e_p95"] <= 1.0
        ]
        for llama, wanted in TARGETS.items()
        if any(llama in against for against in pairs.values())
    }


def print_ratios(slots: int, pairs: Mapping[str, Mapping[str, Mapping[str, float]]]) -> None:
    if not pairs or not next(iter(pairs.values())):
        return
    llamas = list(next(iter(pairs.values())))
    print(f"\nP={slots}: this server / llama-server, tokens/s and e2e p95")
    print(f"{'':<14}" + "".join(f"{llama:>20}" for llama in llamas))
    for ours, against in pairs.items():
        cells = (
            f"{against[llama]['tokens_per_s']:.2f}x / {against[llama]['e2e_p95']:.2f}x"
            for llama in llamas
        )
        print(f"{ours:<14}" + "".join(f"{cell:>20}" for cell in cells))
    for llama, met_by in targets(pairs).items():
        verdict = f"met by {', '.join(met_by)}" if met_by else "not met"
        print(f"  target >= {TARGETS[llama]}x {llama}'s tokens/s at <= its p95: {verdict}")


def llama_version(llama_server: Path) -> str:
    answer = subprocess.run(
        [str(llama_server), "--version"], capture_output=True, text=True, timeout=30
    )
    lines = (answer.stdout + answer.stderr).splitlines()
    version = next((line for line in lines if line.startswith("version: ")), "unknown")
    return version.removeprefix("version: ")


def llama_system_info(llama_server: Path, gguf: Path, timeout_s: float = 30.0) -> str:
    """The CPU features llama-server's build uses on this machine (``AVX2 = 1 |
    ...``): it logs them only at trace verbosity, before it loads the model, so a
    start of its own is stopped as soon as the line is read."""
    command = [str(llama_server), "-lv", "4", "--model", str(gguf)]
    command += ["--host", "127.0.0.1", "--port", str(free_port())]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as process:
        deadline = threading.Timer(timeout_s, process.kill)  # a build that never says
        deadline.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if "system_info:" in line and "|" in line:
                    return line.split("|", 1)[1].strip(" |\n")
        finally:
            deadline.cancel()
            process.kill()
    return "unknown"


def check_llama_files(args: argparse.Namespace) -> None:
    """Refuse to start when a llama engine is asked for and its files are missing."""
    missing = [] if Path(args.llama_server).is_file() else [f"llama-server at {args.llama_server}"]
    missing += [
        f"{gguf_path(args, e)}"
        for e in args.engines
        if e in LLAMA and not gguf_path(args, e).is_file()
    ]
    if missing:
        raise SystemExit(
            f"not found: {', '.join(missing)}. Build llama-server and convert the synthetic "
            f"model ({HOW_TO_BUILD}), then set LLAMA_SERVER to the binary "
            "(or pass --llama-server) and LLAMA_GGUF_DIR to the GGUF folder (or --gguf-dir); "
            "or leave the llama engines out with --engines."
        )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("LLAMA_SERVER", LLAMA_CPP_DIR / "build" / "bin" / "llama-server"),
        help="the llama-server binary (default: LLAMA_SERVER, else the docs' build folder)",
    )
    parser.add_argument(
        "--gguf-dir",
        type=Path,
        default=os.environ.get("LLAMA_GGUF_DIR", LLAMA_CPP_DIR / "models"),
        help="the folder of synthetic-<f32|f16|q8_0>.gguf (default: LLAMA_GGUF_DIR, else "
        "the docs' folder)",
    )
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 32], help="P: slots = users")
    parser.add_argument(
        "--requests", type=int, help="per run (default: 64 at 8 slots, 4 per slot beyond)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs per engine, taking turns")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=list(ENGINES),
        metavar="ENGINE",
        help=f"of {', '.join(ENGINES)} (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--out", type=Path, default=RESULTS / "llama_compare.json")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    engines = [engine for engine in ENGINES if engine in args.engines]
    uses_llama = any(engine in LLAMA for engine in engines)
    if uses_llama:
        check_llama_files(args)
    print(describe_machine(machine()), flush=True)
    report: dict[str, Any] = {
        "settings": {
            "slots": args.slots,
            "requests": {str(p): args.requests or num_requests(p) for p in args.slots},
            "rounds": args.rounds,
            "seed": args.seed,
            "prompt_words": list(PROMPT_WORDS),
            "max_new_tokens": list(MAX_NEW_TOKENS_CHOICES),
            "engines": engines,
            "ours": {engine: OURS[engine] for engine in engines if engine in OURS},
        },
        "slots": {},
    }
    if uses_llama:
        first_llama = next(engine for engine in engines if engine in LLAMA)
        report["llama_server"] = {
            "path": str(args.llama_server),
            "version": llama_version(args.llama_server),
            "system_info": llama_system_info(args.llama_server, gguf_path(args, first_llama)),
            "gguf": {e: str(gguf_path(args, e)) for e in engines if e in LLAMA},
        }
        print(f"llama-server's build runs: {report['llama_server']['system_info']}", flush=True)
    for slots in args.slots:
        runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
        lengths: dict[str, list[int]] = {}
        for round_ in range(args.rounds):
            for engine in engines:
                print(f"P={slots} round {round_ + 1}: {engine}", flush=True)
                records, lengths[engine] = run_once(engine, slots, args)
                runs[engine].append(summarize(records))
        first = engines[0]
        differ = [engine for engine in engines if lengths[engine] != lengths[first]]
        if differ:
            raise SystemExit(
                f"P={slots}: {', '.join(differ)} counted other prompt lengths than {first} "
                f"({lengths[differ[0]][:8]} against {lengths[first][:8]}): not the same workload"
            )
        summaries = {engine: median_summary(results) for engine, results in runs.items()}
        print()
        print(table(summaries))
        pairs = ratios(summaries)
        print_ratios(slots, pairs)
        report["slots"][str(slots)] = {
            "engines": summaries,
            "runs": runs,
            "ratios": pairs,
            "targets_met_by": targets(pairs),
            "prompt_tokens": sum(lengths[first]),
        }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
