"""The llama.cpp comparison's checks and ratios, without either server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench import llama_compare
from bench.report import RequestRecord
from protocol import GenerateRequest

REQUESTS = [GenerateRequest("r-0", "one two", 8), GenerateRequest("r-1", "three", 16)]


def _record(request_id: str, num_tokens: int, num_prompt_tokens: int | None) -> RequestRecord:
    return RequestRecord(
        request_id, 0.0, ended_at=1.0, num_tokens=num_tokens, num_prompt_tokens=num_prompt_tokens
    )


def test_exact_answers_pass_and_give_prompt_lengths_in_workload_order() -> None:
    records = [_record("r-1", 16, 1), _record("r-0", 8, 2)]  # answered out of order
    assert llama_compare.check_tokens("e", REQUESTS, records) == [2, 1]


@pytest.mark.parametrize(
    ("records", "named"),
    [
        ([_record("r-0", 8, 2), _record("r-1", 15, 1)], "r-1: ok, 15 of 16 output tokens"),
        ([_record("r-0", 8, None), _record("r-1", 16, 1)], "r-0: ok, 8 of 8 output tokens, None"),
        ([_record("r-0", 8, 2)], "r-1: no answer"),
    ],
)
def test_a_short_answer_or_a_missing_count_stops_the_run(
    records: list[RequestRecord], named: str
) -> None:
    with pytest.raises(SystemExit, match="1 of 2 requests") as stopped:
        llama_compare.check_tokens("e", REQUESTS, records)
    assert named in str(stopped.value)


def test_a_target_is_met_only_at_no_higher_p95() -> None:
    def summary(tokens_per_s: float, p95_ms: float) -> dict[str, object]:
        return {"tokens_per_s": tokens_per_s, "e2e_ms": {"p95": p95_ms}}

    summaries = {
        "ours-float32": summary(300.0, 900.0),
        "ours-int8": summary(400.0, 1100.0),
        "llama-f16": summary(200.0, 1000.0),
        "llama-q8_0": summary(320.0, 1000.0),
    }
    pairs = llama_compare.ratios(summaries)
    assert pairs["ours-int8"]["llama-q8_0"] == {"tokens_per_s": 1.25, "e2e_p95": 1.1}
    # int8 is fast enough for Q8_0's target, but its p95 is higher than llama-server's.
    assert llama_compare.targets(pairs) == {"llama-f16": ["ours-float32"], "llama-q8_0": []}


def test_a_missing_llama_server_is_refused_before_anything_starts(tmp_path: Path) -> None:
    missing = tmp_path / "llama-server"
    with pytest.raises(SystemExit, match=f"not found: llama-server at {missing}.*LLAMA_SERVER"):
        llama_compare.main(["--llama-server", str(missing), "--gguf-dir", str(tmp_path)])


def test_the_report_names_the_cpu_features_llama_servers_build_runs(tmp_path: Path) -> None:
    """Read from the trace line of a start of its own, which is stopped once read."""
    fake = tmp_path / "llama-server"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "I cmn  common_param: verbosity = 4"\n'
        'echo "I cmn  common_param: system_info: n_threads = 2 / 2 | CPU : AVX2 = 1 | FMA = 1 | "\n'
        "exec sleep 60\n"
    )
    fake.chmod(0o755)
    started = time.monotonic()
    info = llama_compare.llama_system_info(fake, tmp_path / "model.gguf")
    assert info == "CPU : AVX2 = 1 | FMA = 1"
    assert time.monotonic() - started < 30  # not left to run


def test_a_build_that_never_says_its_cpu_features_is_reported_unknown(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: unknown argument: -lv'\nexit 1\n")
    fake.chmod(0o755)
    assert llama_compare.llama_system_info(fake, tmp_path / "model.gguf") == "unknown"
