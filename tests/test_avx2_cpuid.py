"""tests/avx2_cpuid.c, which `tests/run_as_avx2_cpu.sh --cpuid` preloads into every
process of a run: CPUID then reports no AVX-512 to torch, in the process and in
the ones it starts, and a real crash still ends as one, with Python's traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("avx2_cpuid.c")


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or "cpuid_fault" not in cpu_flags() or shutil.which("cc") is None,
    reason="needs Linux, a CPU with CPUID faulting (cpuid_fault) and a C compiler",
)


@pytest.fixture(scope="module")
def preload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = tmp_path_factory.mktemp("avx2_cpuid") / "avx2_cpuid.so"
    subprocess.run(
        [
            "cc",
            "-O2",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            "-o",
            str(library),
            str(SOURCE),
            "-ldl",
        ],
        check=True,
    )
    return library


def run_preloaded(preload: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code],
        env={"LD_PRELOAD": str(preload), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"


def test_torch_sees_no_avx512_in_the_process_or_the_ones_it_starts(preload: Path) -> None:
    code = (
        "import subprocess, sys, torch\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
        "print(torch.ops.mkldnn._is_mkldnn_bf16_supported())\n"
        f"print(subprocess.run([sys.executable, '-c', {CAPABILITY!r}],"
        " capture_output=True, text=True, check=True).stdout.strip())\n"
    )
    result = run_preloaded(preload, code)
    assert result.returncode == 0, result.stderr
    capability, bfloat16, child_capability = result.stdout.split()
    assert capability in {"AVX2", "DEFAULT"}
    assert bfloat16 == "False"  # oneDNN's bfloat16 path needs AVX-512 (or AVX-NE-CONVERT)
    assert child_capability == capability


def test_a_real_segfault_still_ends_the_program_with_pythons_traceback(preload: Path) -> None:
    result = run_preloaded(preload, "import ctypes; ctypes.string_at(0)")
    assert result.returncode == -11
    assert "Fatal Python error: Segmentation fault" in result.stderr
    assert "string_at" in result.stderr
