"""What every benchmark reports, computed one way: per-request records in, a summary,
a table line, JSON with the machine it ran on, and plots out.

Latency statistics are mean, p50, p95 and p99 in milliseconds. Throughput counts
the output tokens of successful requests over the span from the first request
sent to the last one answered.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# Settings that hold ATen's, oneDNN's or the kernels' code below the best this CPU
# runs (to try another machine's code here): a result taken with one of them set
# shows that code on this machine, so it says so.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "KERNEL_ISA")

OK = "ok"

Stats = dict[str, float]


@dataclass
class RequestRecord:
    """One request as a client saw it; times are ``time.perf_counter()`` seconds.

    ``status`` is ``OK`` for success, else the HTTP status or the worker's error
    code. ``chunk_times`` are arrival times of the chunks that carried tokens,
    empty when the request was not streamed. ``server_s`` is the time the server
    reports for the request (its wait for a slot, in the frontend's line and the
    worker's queue, and its generation), when it does: the rest of the client's
    end-to-end time was spent on the way in and out.
    ``num_prompt_tokens`` is the prompt's length as the server counted it, when
    its answer says."""

    request_id: str
    sent_at: float
    status: str = OK
    ended_at: float = 0.0
    num_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    server_s: float | None = None
    num_prompt_tokens: int | None = None

    @property
    def is_ok(self) -> bool:
        return self.status == OK


def latency_stats(values_s: Sequence[float]) -> Stats:
    """Mean and p50/p95/p99 of ``values_s`` (seconds), in milliseconds."""
    if not values_s:
        return {}
    ms = sorted(v * 1000 for v in values_s)
    # quantiles() needs two points; one point is every percentile of itself.
    cuts = ms * 99 if len(ms) == 1 else statistics.quantiles(ms, n=100, method="inclusive")
    return {"mean": statistics.fmean(ms), "p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Throughput, latencies and failures of one run."""
    done = [r for r in records if r.is_ok]
    start = min((r.sent_at for r in records), default=0.0)
    end = max((r.ended_at for r in records), default=start)
    duration_s = max(end - start, 1e-9)
    num_tokens = sum(r.num_tokens for r in done)
    streamed = [r for r in done if r.chunk_times]
    gaps = [b - a for r in streamed for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return {
        "num_requests": len(records),
        "num_succeeded": len(done),
        "failures_by_status": dict(Counter(r.status for r in records if not r.is_ok)),
        "duration_s": duration_s,
        "num_tokens": num_tokens,
        "tokens_per_s": num_tokens / duration_s,
        "requests_per_s": len(done) / duration_s,
        "e2e_ms": latency_stats([r.ended_at - r.sent_at for r in done]),
        "ttft_ms": latency_stats([r.chunk_times[0] - r.sent_at for r in streamed]),
        "itl_ms": latency_stats(gaps),
        "path_overhead_ms": latency_stats(
            [r.ended_at - r.sent_at - r.server_s for r in done if r.server_s is not None]
        ),
    }


def median_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each number's median over repeated runs of one benchmark (each latency
    statistic taken separately), so that one noisy run does not decide; failures
    are added up."""
    first = summaries[0]
    median: dict[str, Any] = {}
    for key, value in first.items():
        if key == "failures_by_status":
            median[key] = dict(sum((Counter(s[key]) for s in summaries), Counter()))
        elif isinstance(value, dict) and all(isinstance(v, float) for v in value.values()):
            median[key] = {
                stat: statistics.median(s[key][stat] for s in summaries) for stat in value
            }
        elif isinstance(value, (int, float)):
            median[key] = statistics.median(s[key] for s in summaries)
        else:
            median[key] = value
    return median


def table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per summary: throughput, then each latency's p50/p95/p99."""
    lines = [
        f"{'':<20} {'ok':>5} {'tok/s':>7} {'req/s':>6}  "
        f"{'e2e p50/p95/p99 ms':>20}  {'ttft p50/p95 ms':>15}  {'itl p50/p95 ms':>14}  "
        f"{'outside worker p50/p95 ms':>25}"
    ]
    for name, s in rows.items():
        lines.append(
            f"{name:<20} {s['num_succeeded']:>5} {s['tokens_per_s']:>7.1f} "
            f"{s['requests_per_s']:>6.2f}  {_cuts(s['e2e_ms'], 3):>20}  "
            f"{_cuts(s['ttft_ms'], 2):>15}  {_cuts(s['itl_ms'], 2):>14}  "
            f"{_cuts(s['path_overhead_ms'], 2, '.1f'):>25}"
        )
        if s["failures_by_status"]:
            lines.append(f"{'':<20} failures by status: {s['failures_by_status']}")
    return "\n".join(lines)


def _cuts(stats: Stats, num: int, spec: str = ".0f") -> str:
    if not stats:
        return "-"
    return "/".join(f"{stats[key]:{spec}}" for key in ("p50", "p95", "p99")[:num])


def machine() -> dict[str, object]:
    """The machine a result came from, saved beside every result."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    described: dict[str, object] = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
    }
    held_to = {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}
    if held_to:
        described["isa_held_to"] = held_to
    try:
        import torch  # the load clients run without torch; only the engine needs it
    except ImportError:
        return described
    from worker.model.cpu_isa import chosen_isa, cpu_summary

    described["torch"] = torch.__version__
    described["torch_threads"] = torch.get_num_threads()
    # The model and the ISA flags that matter, and the kernel build that runs, so
    # that numbers from two machines are never mixed up.
    described["cpu"] = cpu_summary()
    described["kernel_isa"] = chosen_isa()
    if torch.cuda.is_available():
        described["gpu"] = torch.cuda.get_device_name()
    return described


def describe_machine(described: Mapping[str, object]) -> str:
    """One line naming the machine, for the top of every printed report."""
    isa = f", kernels {described['kernel_isa']}" if "kernel_isa" in described else ""
    held_to = described.get("isa_held_to")
    if isinstance(held_to, Mapping):
        isa += ", code held to " + " ".join(f"{name}={value}" for name, value in held_to.items())
    return f"machine: {described['cpu']}, {described['cores']} cores{isa}"


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    described = machine()
    path.write_text(json.dumps({"machine": described, **report}, indent=2) + "\n")
    print(describe_machine(described))
    print(f"saved {path}")


def plot_latencies(path: Path, records: Sequence[RequestRecord], title: str) -> None:
    """Cumulative distributions of end-to-end latency, TTFT and inter-token latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.is_ok]
    series = {
        "end-to-end": [r.ended_at - r.sent_at for r in done],
        "time to first token": [r.chunk_times[0] - r.sent_at for r in done if r.chunk_times],
        "inter-token": [
            b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
        ],
    }
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ms = sorted(v * 1000 for v in values)
        if ms:
            ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))])
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (or gaps)")
    fig.suptitle(title)
    save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"saved {path}")


def report_run(
    label: str, records: Sequence[RequestRecord], settings: Mapping[str, Any], out: Path
) -> dict[str, Any]:
    """Print one run's table line and save its JSON (``out``) and latency plot
    (``out`` with .png); return the summary."""
    summary = summarize(records)
    print(table({label: summary}))
    write_json(out, {"settings": dict(settings), "summary": summary})
    plot_latencies(out.with_suffix(".png"), records, f"{label}: {_describe(settings)}")
    return summary


def _describe(settings: Mapping[str, Any]) -> str:
    keys = ("mode", "concurrency", "rate", "burstiness", "requests")
    return ", ".join(f"{key} {settings[key]}" for key in keys if key in settings)
