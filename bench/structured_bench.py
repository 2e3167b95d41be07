"""Structured outputs' cost to a decode step, in process: 1 of 8 rows and 8 of 8
constrained by a JSON schema, against none, side by side.

Methodology: the synthetic model (distilgpt2's shape and compute), capacity 8,
8 seeded sampled requests with the same prompts in every mode; in "1 of 8" the
first of them, in "8 of 8" all of them, follow a schema whose output is long
(an array of 20 to 40 records of a bounded string, an integer and a boolean),
so that every measured step has all its constrained rows inside the grammar:
in strings, numbers and structure alike. Each mode has an engine of its own
(one copy of the weights, a slot cache each); after the prefills, the three
take turns, one decode step each, 32 times a round, so that a slow spell of a
shared machine falls on the three steps of a turn alike. Reported, per mode:
the median step time over every round, and the median of each turn's ratio to
none's step; and the mask's own share (llguidance filling the bitmask, and the
op that applies it). Targets: at most 10% (1 of 8) and 30% (8 of 8) over none.

    python -m bench.structured_bench [--rounds 5] [--out bench/results/structured.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.engines import mode_engine, sync
from bench.report import RESULTS, write_json
from frontend.structured import compile_grammar
from protocol import GenerateRequest, GrammarKind
from worker.engine import torch_engine
from worker.engine.torch_engine import TorchEngine
from worker.model.loader import LoadedModel, TextTokenizer
from worker.model.token_mask import apply_token_masks

CAPACITY = 8
NUM_TIMED_STEPS = 32
MAX_NEW_TOKENS = NUM_TIMED_STEPS + 8
MODES = {"none": 0, "1 of 8": 1, "8 of 8": 8}
TARGETS = {"1 of 8": 1.10, "8 of 8": 1.30}  # step time over none's, at most
RECORDS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "count", "ok"],
        "additionalProperties": False,
    },
    "minItems": 20,
    "maxItems": 40,
}
PROMPTS = [
    "The records, as JSON:",
    "Here is the inventory",
    "A list of every item we shipped",
    "Output",
    "Results of the survey, one record per answer",
    "Dump",
    "The table below lists",
    "Items",
]


def requests(num_constrained: int, grammar: str) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            f"r{i}",
            prompt,
            MAX_NEW_TOKENS,
            ignore_eos=True,
            temperature=1.0,
            seed=i,
            grammar_kind=GrammarKind.JSON_SCHEMA if i < num_constrained else "",
            grammar=grammar if i < num_constrained else "",
        )
        for i, prompt in enumerate(PROMPTS)
    ]


class MaskTimer:
    """Time spent computing and applying masks, wrapped around the engines' calls."""

    def __init__(self, engines: list[TorchEngine]) -> None:
        self.seconds = 0.0
        for engine in engines:
            assert engine.grammars is not None
            engine.grammars.masks = self._timed(engine.grammars.masks)  # type: ignore[method-assign]
        setattr(torch_engine, "apply_token_masks", self._timed(apply_token_masks))  # noqa: B010

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def timed_step(engine: TorchEngine, timer: MaskTimer) -> tuple[float, float]:
    """One decode step's seconds, and of them the mask's."""
    timer.seconds = 0.0
    started = time.perf_counter()
    output = engine.step()
    sync(engine.device)
    elapsed = time.perf_counter() - started
    assert not output.finished and not output.failed, "a sequence ended while timed"
    return elapsed, timer.seconds


def run_round(
    engines: dict[str, TorchEngine], batches: dict[str, list[GenerateRequest]], timer: MaskTimer
) -> dict[str, dict[str, list[float]]]:
    """Admit each mode's batch into its engine, then step the engines in turn."""
    for mode, engine in engines.items():
        engine.admit(batches[mode])
        engine.step()  # the prefill's token goes out; the decode steps follow
    times: dict[str, dict[str, list[float]]] = {
        mode: {"step_ms": [], "mask_ms": []} for mode in engines
    }
    for _ in range(NUM_TIMED_STEPS):
        for mode, engine in engines.items():
            step_s, mask_s = timed_step(engine, timer)
            times[mode]["step_ms"].append(step_s * 1000)
            times[mode]["mask_ms"].append(mask_s * 1000)
    for mode, engine in engines.items():
        engine.abort([r.request_id for r in batches[mode]])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    first = mode_engine("float32", CAPACITY, args.device)
    assert isinstance(first.tokenizer, TextTokenizer)  # what load_engine gives a real model
    info = first.info
    loaded = LoadedModel(info.name, first.model, first.tokenizer, info.is_random_weights)
    engines = {"none": first}
    for mode in list(MODES)[1:]:
        engines[mode] = TorchEngine(loaded, CAPACITY, precision=first.precision, gpt2=first.gpt2)
    grammar, problem = compile_grammar(GrammarKind.JSON_SCHEMA, RECORDS)
    assert problem is None, problem
    timer = MaskTimer(list(engines.values()))
    batches = {mode: requests(num, grammar) for mode, num in MODES.items()}
    run_round(engines, batches, timer)  # warm-up: compiles the grammar, builds the lexer
    steps: dict[str, dict[str, list[float]]] = {m: {"step_ms": [], "mask_ms": []} for m in MODES}
    for _ in range(args.rounds):
        for mode, times in run_round(engines, batches, timer).items():
            for key, values in times.items():
                steps[mode][key] += values
    medians = {
        mode: {key: statistics.median(values) for key, values in times.items()}
        for mode, times in steps.items()
    }
    none_ms = steps["none"]["step_ms"]
    ratios = {
        mode: statistics.median(
            step / none for step, none in zip(steps[mode]["step_ms"], none_ms, strict=True)
        )
        for mode in TARGETS
    }
    print(f"{'constrained rows':<18} {'step ms':>8} {'mask ms':>8} {'vs none':>8}  target")
    for mode, median in medians.items():
        ratio = ratios.get(mode, 1.0)
        limit = TARGETS.get(mode)
        target = f"<= {limit:.2f}x: {'met' if ratio <= limit else 'MISSED'}" if limit else ""
        print(
            f"{mode:<18} {median['step_ms']:>8.2f} {median['mask_ms']:>8.2f} {ratio:>7.3f}x  "
            f"{target}"
        )
    write_json(
        args.out,
        {
            "workload": {
                "capacity": CAPACITY,
                "model": info.name,
                "timed_steps_per_round": NUM_TIMED_STEPS,
                "schema": RECORDS,
                "prompt_tokens": [len(first.tokenizer.encode(p)) for p in PROMPTS],
            },
            "rounds": args.rounds,
            "median": medians,
            "median_ratio_over_none": ratios,
            "targets": TARGETS,
            "targets_met": {mode: ratios[mode] <= TARGETS[mode] for mode in TARGETS},
            "steps": steps,
        },
    )


if __name__ == "__main__":
    main()
