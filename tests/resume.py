"""Resuming a stream at every point where a worker could have died, held to the
run that was never interrupted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from protocol import GenerateRequest
from worker.engine.interface import FinishedSequence
from worker.engine.slot_engine import SlotEngine


@dataclasses.dataclass
class Run:
    delta_texts: list[str]  # one per delta, in order
    delta_token_ids: list[list[int]]
    delta_logprobs: list[list[float]]  # each delta's tokens' logprobs, when asked for
    result: FinishedSequence


def run(engine: SlotEngine, request: GenerateRequest) -> Run:
    """Admit one streaming request alone and step it to its end."""
    engine.admit([request])
    texts: list[str] = []
    token_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    while True:
        output = engine.step()
        for delta in output.deltas:
            texts.append(delta.text)
            token_ids.append(delta.token_ids)
            logprobs.append(delta.logprobs.logprobs if delta.logprobs else [])
        if output.finished:
            [result] = output.finished
            return Run(texts, token_ids, logprobs, result)


def assert_every_resume_is_exact(
    new_engine: Callable[[], SlotEngine], request: GenerateRequest
) -> FinishedSequence:
    """Cut the fault-free run after each of its deltas; the resumed run on a fresh
    engine must show the same text, tokens and finish reason. Returns the
    fault-free result."""
    fault_free = run(new_engine(), request)
    full_text = "".join(fault_free.delta_texts)
    assert full_text == fault_free.result.text
    for cut in range(1, len(fault_free.delta_texts) + 1):
        streamed_ids = [t for ids in fault_free.delta_token_ids[:cut] for t in ids]
        shown = "".join(fault_free.delta_texts[:cut])
        resumed_request = dataclasses.replace(
            request, resume_token_ids=streamed_ids, resume_text_len=len(shown)
        )
        resumed = run(new_engine(), resumed_request)
        assert shown + "".join(resumed.delta_texts) == full_text, f"cut after {cut} deltas"
        new_ids = [t for ids in resumed.delta_token_ids for t in ids]
        assert streamed_ids + new_ids == fault_free.result.token_ids
        assert resumed.result.token_ids == fault_free.result.token_ids
        assert resumed.result.text == fault_free.result.text
        assert resumed.result.finish_reason == fault_free.result.finish_reason
        assert resumed.result.num_prompt_tokens == fault_free.result.num_prompt_tokens
    return fault_free.result
