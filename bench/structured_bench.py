"""Structured outputs' cost to a decode step, in process: 1 of 8 rows and 8 of 8
constrained by a JSON schema, against none, side by side.

Methodology: the synthetic model (distilgpt2's shape and compute), capacity 8,
8 seeded sampled requests with the same prompts in every mode; in "1 of 8" the
first of them, in "8 of 8" all of them, follow a schema whose output is long
(an array of 20 to 40 records of a bounded string, an integer and a boolean),
so that every measured step has all its constrained rows inside the grammar:
in strings, numbers and structure alike. After the prefill, 32 decode steps
are timed one by one; a mode's step time is the median of those steps, and the
report the median over runs that alternate the modes (after a warm-up of each),
so that a slow spell of a shared machine hits every mode alike. The mask's own
share (llguidance filling the bitmask, and the one op that applies it) is
timed too. Targets: at most 10% (1 of 8) and 30% (8 of 8) over none.

    python -m bench.structured_bench [--runs 5] [--out bench/results/structured.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.engines import mode_engine, sync
from bench.report import write_json
from frontend.structured import compile_grammar
from protocol import GenerateRequest, GrammarKind
from worker.engine import torch_engine
from worker.engine.torch_engine import TorchEngine
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
    """Time spent computing and applying masks, wrapped around the engine's calls."""

    def __init__(self, engine: TorchEngine) -> None:
        self.seconds = 0.0
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


def run(engine: TorchEngine, batch: list[GenerateRequest], timer: MaskTimer) -> dict[str, float]:
    """Admit ``batch``, then time its next NUM_TIMED_STEPS steps one by one."""
    engine.admit(batch)
    engine.step()  # the prefill's token goes out; the decode steps follow
    step_s = []
    timer.seconds = 0.0
    for _ in range(NUM_TIMED_STEPS):
        started = time.perf_counter()
        output = engine.step()
        sync(engine.device)
        step_s.append(time.perf_counter() - started)
        assert not output.finished and not output.failed, "a sequence ended while timed"
    mask_ms = timer.seconds * 1000 / NUM_TIMED_STEPS
    engine.abort([r.request_id for r in batch])
    return {"step_ms": statistics.median(step_s) * 1000, "mask_ms": mask_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    engine = mode_engine("float32", CAPACITY, args.device)
    grammar, problem = compile_grammar(GrammarKind.JSON_SCHEMA, RECORDS)
    assert problem is None, problem
    timer = MaskTimer(engine)
    batches = {mode: requests(num, grammar) for mode, num in MODES.items()}
    for batch in batches.values():  # warm-up: compiles the grammar, builds the lexer
        run(engine, batch, timer)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.runs):
        for mode, batch in batches.items():
            runs[mode].append(run(engine, batch, timer))
    medians = {
        mode: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for mode, results in runs.items()
    }
    none_ms = medians["none"]["step_ms"]
    ratios = {mode: medians[mode]["step_ms"] / none_ms for mode in TARGETS}
    print(f"{'constrained rows':<18} {'step ms':>8} {'mask ms':>8} {'vs none':>8}  target")
    for mode, median in medians.items():
        ratio = median["step_ms"] / none_ms
        target = f"<= {TARGETS[mode]:.2f}x: {'met' if ratio <= TARGETS[mode] else 'MISSED'}"
        print(
            f"{mode:<18} {median['step_ms']:>8.2f} {median['mask_ms']:>8.2f} {ratio:>7.3f}x  "
            f"{target if mode in TARGETS else ''}"
        )
    write_json(
        args.out,
        {
            "workload": {
                "capacity": CAPACITY,
                "model": engine.info.name,
                "timed_steps": NUM_TIMED_STEPS,
                "schema": RECORDS,
                "prompt_tokens": [len(engine.tokenizer.encode(p)) for p in PROMPTS],
            },
            "median_of_runs": args.runs,
            "median": medians,
            "runs": runs,
            "ratios_over_none": ratios,
            "targets": TARGETS,
            "targets_met": {mode: ratios[mode] <= TARGETS[mode] for mode in TARGETS},
        },
    )


if __name__ == "__main__":
    main()
