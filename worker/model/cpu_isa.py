"""What this CPU runs: its feature flags (``/proc/cpuinfo``), the instruction
sets the decode kernels are built for, and the one a worker loads
(``KERNEL_ISA``, or the best this CPU runs). Without torch, so that the
supervisor refuses a KERNEL_ISA or ATEN_CPU_CAPABILITY this CPU cannot run
before it starts anything, and a benchmark's report names the CPU."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping
from pathlib import Path

from protocol.settings import ConfigError

# Best first. Each ISA: the compiler flags it builds with, and the /proc/cpuinfo
# flags a CPU needs to run that build (x86-64-v3 and -v4, and VNNI on top).
_X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ISAS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx512_vnni": (["-march=x86-64-v4", "-mavx512vnni"], _X86_64_V4 | {"avx512_vnni"}),
    "avx512": (["-march=x86-64-v4"], _X86_64_V4),
    "avx2": (["-march=x86-64-v3"], _X86_64_V3),
    "baseline": (["-march=x86-64"] if platform.machine() == "x86_64" else [], frozenset()),
}


class KernelIsaError(ConfigError):
    """KERNEL_ISA names an ISA that is unknown or that this CPU cannot run."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags the kernel reports for this CPU (x86 Linux), else none;
    read once (every projection asks which build to load)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def l2_cache_bytes() -> int | None:
    """One core's L2 cache in bytes, as Linux reports it in sysfs, else None."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "2":
                continue
            size = (index / "size").read_text().strip()  # "1024K", "2048K", "2M"
        except OSError:
            continue
        units = {"K": 1024, "M": 1024 * 1024}
        try:
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            return None
    return None


def runnable_isas() -> list[str]:
    """The ISAS this CPU runs, best first ("baseline" always)."""
    if platform.machine() != "x86_64":
        return ["baseline"]
    flags = cpu_flags()
    return [isa for isa, (_, needs) in ISAS.items() if needs <= flags]


def chosen_isa(environ: Mapping[str, str] = os.environ) -> str:
    """KERNEL_ISA if set (and runnable here), else the best ISA this CPU runs."""
    runnable = runnable_isas()
    asked = environ.get("KERNEL_ISA", "").strip().lower()  # AVX2, as oneDNN spells it
    if not asked:
        return runnable[0]
    if asked not in ISAS:
        raise KernelIsaError(
            f"KERNEL_ISA={asked} is not one of {', '.join(ISAS)}: set one of those this CPU "
            f"runs ({', '.join(runnable)}), or unset it for the best of them"
        )
    if asked not in runnable:
        missing = sorted(ISAS[asked][1] - cpu_flags())
        raise KernelIsaError(
            f"KERNEL_ISA={asked} needs CPU features this CPU lacks ({', '.join(missing)}): "
            f"unset KERNEL_ISA, or set it to one of {', '.join(runnable)}"
        )
    return asked


# The instruction sets torch's own kernels run under each ATEN_CPU_CAPABILITY.
# torch trusts the variable over the CPU: one the CPU lacks serves its hello,
# then dies of an illegal instruction in the first step that uses them.
_ATEN_CAPABILITIES = {"avx2": ISAS["avx2"][1], "avx512": ISAS["avx512"][1]}


def check_aten_capability(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse an ATEN_CPU_CAPABILITY (torch's own setting) that this CPU cannot run.
    As torch reads it: spelt exactly (torch ignores AVX512 or " avx512", with a
    warning, and runs what the CPU has)."""
    asked = environ.get("ATEN_CPU_CAPABILITY", "")
    needs = _ATEN_CAPABILITIES.get(asked)
    if platform.machine() != "x86_64" or needs is None:
        return
    missing = sorted(needs - cpu_flags())
    if missing:
        runs = [cap for cap, caps in _ATEN_CAPABILITIES.items() if caps <= cpu_flags()]
        raise ConfigError(
            f"ATEN_CPU_CAPABILITY={asked} makes torch run code this CPU lacks "
            f"({', '.join(missing)}), which would die of an illegal instruction on the "
            "first request: unset ATEN_CPU_CAPABILITY, or set it to one this CPU runs "
            f"({', '.join([*runs, 'default'])})"
        )


def cpu_summary() -> str:
    """The CPU model and the ISA flags that matter here, for logs and bench reports."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    interesting = ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16"]
    interesting += ["amx_bf16", "amx_int8"]
    flags = cpu_flags()
    return f"{model} [{' '.join(flag for flag in interesting if flag in flags) or 'no SIMD flags'}]"
