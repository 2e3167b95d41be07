"""The decode kernels against torch's own ops, and the code that chooses them."""

from __future__ import annotations

import logging
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from protocol.settings import ConfigError  # noqa: E402
from tests.model_fixtures import force_kernels, tiny_engine  # noqa: E402
from worker.model import cpu_isa  # noqa: E402
from worker.model import kernels as kernels_module  # noqa: E402
from worker.model import projection as projection_module  # noqa: E402
from worker.model.cpu_isa import (  # noqa: E402
    KernelIsaError,
    check_aten_capability,
    chosen_isa,
    cpu_flags,
    l2_cache_bytes,
    runnable_isas,
)
from worker.model.kernels import (  # noqa: E402
    MAX_ROWS,
    Kernels,
    build,
    build_directory,
    library_path,
    load_kernels,
    unpack_weight,
)
from worker.model.precision import (  # noqa: E402
    MODES,
    WEIGHT_FORMATS,
    Precision,
    cpu_modes,
    has_bfloat16_products,
)
from worker.model.projection import (  # noqa: E402
    Projection,
    num_matmul_shapes,
    padded_rows,
    quantize_int8,
)

if shutil.which("c++") is None:
    pytest.skip("no C++ compiler to build the decode kernels with", allow_module_level=True)


# Every build this CPU runs, the best first: each must compute the same products.
@pytest.fixture(scope="module", params=runnable_isas())
def kernels(request: pytest.FixtureRequest) -> Kernels:
    built = load_kernels(request.param)
    assert built is not None, (
        "the decode kernels are not built: run `python -m worker.model.kernels`"
    )
    return built


# --- which build runs ---------------------------------------------------------------

AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"})


def test_the_kernels_loaded_are_the_best_build_this_cpu_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KERNEL_ISA", raising=False)
    loaded = load_kernels()
    assert loaded is not None
    flags = cpu_flags()
    if platform.machine() != "x86_64":
        assert loaded.isa == "baseline"
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"} <= flags:
        assert loaded.isa == "avx512_vnni" and loaded.int8_products == "vnni"
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        assert loaded.isa == "avx512" and loaded.int8_products == "integer"
    elif AVX2_ONLY - {"sse2"} <= flags:
        assert loaded.isa == "avx2" and loaded.int8_products == "integer"
    else:
        assert loaded.isa == "baseline"
    lanes = {"avx512_vnni": 16, "avx512": 16, "avx2": 8, "baseline": 4}[loaded.isa]
    assert getattr(torch.ops, f"minibatch_{loaded.isa}").vector_lanes() == lanes


def test_an_avx2_cpu_gets_the_avx2_build_and_is_refused_avx512(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: AVX2_ONLY)
    monkeypatch.delenv("KERNEL_ISA", raising=False)
    assert runnable_isas() == ["avx2", "baseline"] and chosen_isa() == "avx2"
    monkeypatch.setenv("KERNEL_ISA", "avx512")
    with pytest.raises(KernelIsaError, match=r"lacks \(avx512bw, avx512cd.*set it to one of avx2"):
        chosen_isa()
    monkeypatch.setenv("KERNEL_ISA", "sse9")
    with pytest.raises(
        KernelIsaError, match=r"not one of avx512_vnni, avx512, avx2, baseline: .* runs \(avx2, b"
    ):
        chosen_isa()
    monkeypatch.setenv("KERNEL_ISA", " AVX2 ")  # as ONEDNN_MAX_CPU_ISA spells it
    assert chosen_isa() == "avx2"


def test_an_aten_capability_the_cpu_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch trusts ATEN_CPU_CAPABILITY over the CPU: on a Zen 3, avx512 served its
    hello, then died of SIGILL on its first request. Spelt otherwise (AVX512),
    torch ignores it, and so does the check."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: AVX2_ONLY)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    with pytest.raises(ConfigError, match=r"lacks \(avx512bw.*one this CPU runs \(avx2, default\)"):
        check_aten_capability()
    for runnable in ("avx2", "default", "", "AVX512", " avx512"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", runnable)
        check_aten_capability()


@pytest.mark.parametrize(
    "damage", ["empty", "cut short", "not a library", "another build", "a directory"]
)
def test_a_damaged_build_is_said_and_skipped_then_built_again(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A library cut short (a copy that ran out of disk) killed the worker with
    SIGBUS as torch loaded it; an empty one raised in every worker start; another
    build's library under this one's name (whole, and loaded) raised too, a crash
    loop under minibatch-serve; and the build skipped each as built."""
    built = library_path("baseline").read_bytes()
    other_build = library_path("avx2").read_bytes()
    monkeypatch.setenv("KERNELS_DIR", str(tmp_path))
    kernels_module._load.cache_clear()
    damaged = library_path("baseline")  # in tmp_path now
    damaged.parent.mkdir(parents=True)
    if damage == "a directory":
        damaged.mkdir()
        remove = f"rm -r {damaged}"
    else:
        contents = {
            "empty": b"",
            "cut short": built[:100_000],
            "not a library": b"x" * 99,
            "another build": other_build,
        }
        damaged.write_bytes(contents[damage])
        remove = f"rm {damaged}"
    with caplog.at_level(logging.WARNING):
        assert load_kernels("baseline") is None
    assert f"`{remove} && KERNELS_DIR={tmp_path} " in caplog.text
    kernels_module._load.cache_clear()

    class Compiling(Exception):
        pass

    def compile_(*_: object, **__: object) -> None:
        raise Compiling

    monkeypatch.setattr(subprocess, "run", compile_)
    with pytest.raises(Compiling):  # built again, not skipped as built
        build(["baseline"])


def test_a_whole_build_is_whole() -> None:
    assert kernels_module.is_whole_library(library_path(chosen_isa()))


def test_a_worker_without_built_kernels_serves_without_them_and_never_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *_, **__: pytest.fail("compiled"))
    with caplog.at_level(logging.WARNING):
        assert load_kernels("baseline") is None
    # What builds where this worker looks: its KERNELS_DIR, its compiler (each
    # builds into a directory of its own), its Python.
    command = f"KERNELS_DIR={tmp_path} CXX={kernels_module._compiler()} {sys.executable} -m"
    assert f"`{command} worker.model.kernels`" in caplog.text
    kernels_module._load.cache_clear()  # the next test loads the real build again


def test_a_build_that_exists_is_not_compiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    assert library_path(chosen_isa()).exists()
    monkeypatch.setattr(subprocess, "run", lambda *_, **__: pytest.fail("compiled again"))
    assert build([chosen_isa()]) == build_directory()


@pytest.mark.skipif(shutil.which(kernels_module._compiler()) is None, reason="needs a compiler")
@pytest.mark.parametrize(
    "stop_signal",
    [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_build_stopped_by_a_signal_to_its_job_stops_at_once_and_keeps_nothing(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    """^C in `make install`: the compiles still queued ran on, a minute on 2
    cores, and it ended with a KeyboardInterrupt traceback. SIGTERM and SIGHUP
    (a closed terminal) left its scratch directory behind."""
    build = subprocess.Popen(
        [sys.executable, "-m", "worker.model.kernels"],
        env={**os.environ, "KERNELS_DIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a process group of its own, as a terminal's job is
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.glob("tmp*")):  # the scratch directory: compiling
            assert build.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(build.pid, stop_signal)  # as ^C reaches the whole job
        output, _ = build.communicate(timeout=15)
    finally:
        build.kill()
    assert build.returncode == 128 + stop_signal, output
    assert b"build was interrupted" in output and b"Traceback" not in output
    assert output.startswith(b"building the decode kernels for ")  # said before it compiled
    assert not list(tmp_path.glob("*/*"))  # no library, no scratch directory


def test_the_build_directory_does_not_depend_on_where_the_sources_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second checkout (or a container) with the same sources loads the same
    build instead of compiling its own."""
    copy = tmp_path / "csrc"
    shutil.copytree(kernels_module.SOURCE_DIRECTORY, copy)
    here = build_directory()
    monkeypatch.setattr(kernels_module, "SOURCE_DIRECTORY", copy)
    assert build_directory() == here
    (copy / "vec.h").write_text((copy / "vec.h").read_text() + "\n// changed\n")
    assert build_directory() != here


# What a CPU with AVX2, FMA and F16C alone (x86-64-v3, a Zen 3 EPYC) cannot run:
# AVX-512's registers (zmm, the upper 16 xmm/ymm, the masks) and the instructions
# it added for narrower vectors too, and dot products (VNNI, bfloat16) in either
# encoding.
_BEYOND_AVX2 = re.compile(
    r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|\b(vpternlog|vpermt2|vpermi2|vpcompress|"
    r"vcompress|vpexpand|vexpand|vrndscale|vscalef|vgetexp|vgetmant|vfixupimm|vpconflict|"
    r"vplzcnt|vpabsq|vpmullq|vpmov[dqw][bdw]|vcvt[tu]?[pqs][sdq]2u|vcvtu|kmov|kor|kand|"
    r"vpdp|vdpbf16|vcvtne)"
)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 builds only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_the_builds_for_cpus_without_avx512_hold_nothing_an_avx2_cpu_lacks(isa: str) -> None:
    """An image built on an AVX-512 machine runs on an AVX2-only one: its AVX2 and
    baseline builds must not fault there with an illegal instruction."""
    assert library_path(isa).exists(), "run `python -m worker.model.kernels`"
    disassembly = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library_path(isa))],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "vfmadd" in disassembly or isa == "baseline"  # the disassembly is real
    found = sorted({line.strip() for line in disassembly.splitlines() if _BEYOND_AVX2.search(line)})
    assert not found, f"the {isa} build holds code past AVX2: {found[:5]}"


# --- skinny_linear ------------------------------------------------------------------


def operands(
    num_rows: int, in_features: int, out_features: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    return x, weight, bias


def stored(weight: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight`` as the kernel reads it in ``format``, and its scale (int8 only)."""
    if format == "int8":
        return quantize_int8(weight)
    return weight.to(getattr(torch, format)), None


def widened(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What a stored weight stands for, in float64."""
    return weight.double() * (1 if scale is None else scale.double()[:, None])


def as_the_kernel_multiplies(x: torch.Tensor, kernels: Kernels, format: str) -> torch.Tensor:
    """x as the kernel multiplies it, in float64: int8 weights with integer products
    round each row of x to 14 bits with a scale of its own (skinny_linear.cpp)."""
    if format != "int8" or kernels.int8_products == "float":
        return x.double()
    step = x.abs().amax(dim=1, keepdim=True) / 8191
    return (torch.round(x * (1 / step)) * step).double()


@pytest.mark.parametrize("num_rows", range(1, MAX_ROWS + 1))
# Out features that leave a partial last panel (panels are 8 columns on AVX2, 32
# on AVX-512), a single column, and a width of one vector.
@pytest.mark.parametrize("shape", [(32, 1), (64, 37), (768, 2305), (3072, 70)])
@pytest.mark.parametrize("has_bias", [True, False])
def test_skinny_linear_matches_f_linear(
    kernels: Kernels, num_rows: int, shape: tuple[int, int], has_bias: bool
) -> None:
    x, weight, bias = operands(num_rows, *shape)
    bias = bias if has_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32 rounding over up to 3072 products, against a float64 reference.
    torch.testing.assert_close(
        kernels.skinny_linear(x, weight, None, bias), expected.float(), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("format", WEIGHT_FORMATS)
@pytest.mark.parametrize("num_rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("shape", [(64, 37), (768, 2305)])
def test_skinny_linear_reads_each_stored_format(
    kernels: Kernels, format: str, num_rows: int, shape: tuple[int, int]
) -> None:
    """The kernel widens the stored weight exactly and sums in float32 (or, for
    int8, multiplies rows of x rounded to 14 bits in integers): the result is the
    float64 product with the stored weight, to float32 rounding."""
    x, weight, bias = operands(num_rows, *shape)
    weight, scale = stored(weight, format)
    expected = F.linear(
        as_the_kernel_multiplies(x, kernels, format), widened(weight, scale), bias.double()
    )
    got = kernels.skinny_linear(x, weight, scale, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("format", WEIGHT_FORMATS)
def test_a_packed_weight_unpacks_to_itself_with_zero_padded_panels(
    kernels: Kernels, format: str
) -> None:
    _, weight, _ = operands(1, 64, 37)
    weight, _ = stored(weight, format)
    packed = kernels.pack_weight(weight)
    columns = getattr(torch.ops, f"minibatch_{kernels.isa}").panel_columns()
    assert packed.shape[0] == -(-37 // columns) and packed.shape[2] == columns
    assert packed.dtype == weight.dtype
    assert torch.equal(unpack_weight(packed, 37), weight)
    padded = unpack_weight(packed, packed.shape[0] * columns)
    assert not padded[37:].any()


@pytest.mark.parametrize("format", WEIGHT_FORMATS)
def test_each_row_of_the_kernel_is_bit_for_bit_the_same_whatever_its_batch(
    kernels: Kernels, format: str
) -> None:
    """Each output is one chain over k, whatever the number of rows (and so the
    panels taken together, and a decode step's tiles or a prefill's row groups):
    exact resumes rely on it, in every build."""
    x, weight, bias = operands(MAX_ROWS, 768, 2305)
    weight, scale = stored(weight, format)
    packed = kernels.pack_weight(weight)
    together = kernels.packed_linear(x, packed, 2305, scale, bias)
    for start in range(MAX_ROWS):
        for num_rows in range(1, MAX_ROWS - start + 1):
            rows = x[start : start + num_rows]
            alone = kernels.packed_linear(rows, packed, 2305, scale, bias)
            assert torch.equal(alone, together[start : start + num_rows]), (start, num_rows)
    # A prefill's rows, in one call, row groups and a short last one (9 to 43 rows).
    for num_rows in (MAX_ROWS + 1, 2 * MAX_ROWS + 3, 43):
        many, _, _ = operands(num_rows, 768, 2305, seed=1)
        prefill = kernels.packed_linear(many, packed, 2305, scale, bias)
        for i in range(0, num_rows, MAX_ROWS):
            decode = kernels.packed_linear(many[i : i + MAX_ROWS], packed, 2305, scale, bias)
            assert torch.equal(prefill[i : i + MAX_ROWS], decode), (num_rows, i)


@pytest.mark.parametrize(
    ("x", "weight", "message"),
    [
        (torch.zeros(0, 16), torch.zeros(4, 16), "1 row or more"),
        (torch.zeros(2, 48), torch.zeros(4, 48), "multiple of 32"),
        (torch.zeros(2, 16), torch.zeros(4, 32), "in_features must match"),
        (torch.zeros(16, 2).t(), torch.zeros(4, 16), "contiguous"),
        (torch.zeros(2, 16, dtype=torch.float64), torch.zeros(4, 16), "float32 x"),
        (torch.zeros(2, 16), torch.zeros(4, 16, dtype=torch.float64), "int8 weight"),
        (torch.zeros(2, 16), torch.zeros(4, 16, dtype=torch.int8), "needs its scale"),
    ],
)
def test_skinny_linear_rejects_what_it_cannot_compute(
    kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        kernels.skinny_linear(x, weight, None, None)


@pytest.mark.parametrize("num_rows", [1, MAX_ROWS, MAX_ROWS + 1, 40])
def test_projection_on_the_kernel_path_takes_every_row_count_in_one_call(
    num_rows: int,
) -> None:
    """Prefill's rows too, so that a token's keys do not depend on whether it was
    prefilled or decoded; in one call, which reads the weight once."""
    x, weight, bias = operands(num_rows, 64, 96)
    projection = Projection(weight, bias, "float16")
    assert projection.decode_path == "kernel"
    kernel = projection.skinny_linear
    assert kernel is not None
    kernel_rows: list[int] = []

    def counting_kernel(
        rows: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        kernel_rows.append(rows.shape[0])
        return kernel(rows, packed, out_features, scale, bias)

    projection.skinny_linear = counting_kernel
    y = projection(x.view(num_rows, 1, 64))  # leading dims are kept
    assert y.shape == (num_rows, 1, 96)
    torch.testing.assert_close(y[:, 0], F.linear(x, projection.stored_weight.float(), bias))
    assert kernel_rows == [num_rows]


@pytest.mark.parametrize("l2_kib", [256, 512, 1024, 2048])
@pytest.mark.parametrize("format", WEIGHT_FORMATS)
@pytest.mark.parametrize("isa", ["avx512_vnni", "avx512", "avx2", "baseline"])
def test_each_projection_takes_one_path_by_a_rule_not_a_timing(
    format: str, isa: str, l2_kib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker on a machine then chooses alike, and a replay on another
    worker continues bit for bit: the kernel, but for float32 where a core's L2
    cannot hold its build's panels for a group of rows (under 2 MiB for
    AVX-512, 512 KiB for AVX2: there oneDNN's prefill is the faster), and on
    the baseline build."""
    if isa not in runnable_isas():
        pytest.skip(f"this CPU does not run the {isa} build")
    monkeypatch.setenv("KERNEL_ISA", isa)
    monkeypatch.setattr(projection_module, "l2_cache_bytes", lambda: l2_kib * 1024)
    _, weight, bias = operands(3, 64, 96)
    min_l2_kib = {"avx512_vnni": 2048, "avx512": 2048, "avx2": 512}.get(isa)
    float32_on_kernel = min_l2_kib is not None and l2_kib >= min_l2_kib
    expected = "onednn" if format == "float32" and not float32_on_kernel else "kernel"
    assert Projection(weight, bias, format).decode_path == expected


def test_the_l2_size_is_read_from_sysfs_where_linux_reports_it() -> None:
    sysfs = Path("/sys/devices/system/cpu/cpu0/cache")
    if not sysfs.exists():
        pytest.skip("no cache sizes in sysfs here")
    levels = {(index / "level").read_text().strip(): index for index in sysfs.glob("index*")}
    if "2" not in levels:
        pytest.skip("sysfs reports no L2 here")
    size = l2_cache_bytes()
    assert size is not None and size % 1024 == 0
    assert f"{size // 1024}K" == (levels["2"] / "size").read_text().strip()


@pytest.mark.parametrize("path", ["kernel", "onednn"])
@pytest.mark.parametrize("format", WEIGHT_FORMATS)
def test_a_rows_product_does_not_depend_on_its_batchmates(path: str, format: str) -> None:
    """Bit for bit, on either path, whatever the number of rows: a lone row, a
    decode batch, a prefill."""
    x, weight, bias = operands(40, 768, 96)
    projection = Projection(weight, bias, format)
    if path == "kernel" and projection.skinny_linear is None:
        pytest.skip("no kernels built")
    projection.decode_path = path
    together = projection(x)
    for num_rows in (1, 2, 3, MAX_ROWS, MAX_ROWS + 1, 17):
        assert torch.equal(projection(x[:num_rows]), together[:num_rows]), num_rows
    assert torch.equal(projection(x[5:6]), together[5:6])


@pytest.mark.parametrize("format", WEIGHT_FORMATS)
def test_a_projection_on_the_kernel_path_keeps_only_the_packed_copy(format: str) -> None:
    _, weight, bias = operands(3, 64, 96)
    projection = Projection(weight, bias, format)
    if projection.skinny_linear is None:
        pytest.skip("no kernels built")
    projection_module.decode_path(projection)
    if projection.decode_path == "kernel":
        assert projection.packed_weight is not None and projection._stored_weight is None
        assert projection.decode_bytes >= projection.packed_weight.nbytes
        assert projection._dense_weight is None  # no float32 copy beside it
    else:
        assert projection.packed_weight is None and projection._stored_weight is not None
    expected, _ = stored(weight, format)
    assert torch.equal(projection.stored_weight, expected)


def test_projection_without_the_kernel_uses_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projection_module, "load_kernels", lambda: None)
    x, weight, bias = operands(3, 64, 96)
    projection = Projection(weight, bias, "float32")
    assert projection.skinny_linear is None and projection.is_packed
    torch.testing.assert_close(projection(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("format", WEIGHT_FORMATS)
@pytest.mark.parametrize("num_rows", [MAX_ROWS, 40])
def test_a_stored_projection_multiplies_by_the_same_weight_on_every_path(
    format: str, num_rows: int
) -> None:
    """Decode (the kernel) and prefill (oneDNN) must agree on the rounded weight, or
    a token's keys would depend on whether it was prefilled or decoded."""
    x, weight, bias = operands(num_rows, 64, 96)
    projection = Projection(weight, bias, format)
    assert projection.stored_weight.dtype == getattr(torch, format)
    loaded = load_kernels()
    on_kernel = projection.decode_path == "kernel"
    rows = as_the_kernel_multiplies(x, loaded, format) if on_kernel and loaded else x.double()
    expected = F.linear(rows, widened(projection.stored_weight, projection.scale), bias.double())
    torch.testing.assert_close(projection(x), expected.float(), rtol=1e-5, atol=1e-4)


def test_prefill_row_counts_are_padded_to_few_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN keeps a primitive per row count: ever new counts grew memory."""
    sizes = {padded_rows(n) for n in range(MAX_ROWS + 1, 8193)}
    assert len(sizes) <= 4 * 11  # four sizes per doubling
    assert all(n <= padded_rows(n) < 1.25 * n + 8 for n in range(MAX_ROWS + 1, 8193))
    monkeypatch.setattr(projection_module, "_matmul_shapes", set())
    x, weight, bias = operands(100, 64, 96)
    projection = Projection(weight, bias, "float32")
    projection.decode_path = "onednn"  # as for float32 where the L2 is too small
    for num_rows in (97, 100, 112, 9):
        torch.testing.assert_close(projection(x[:num_rows]), F.linear(x[:num_rows], weight, bias))
    assert num_matmul_shapes() == 2  # (112, 96, 64) and (16, 96, 64)


def test_int8_keeps_each_output_channels_range() -> None:
    weight = torch.randn(6, 32) * torch.tensor([1e-3, 1e-1, 1, 10, 100, 1e4])[:, None]
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max(dim=1).values.min()) == 127
    # Rounding to the nearest step: within half a step of each channel's own scale.
    assert bool(((widened(q, scale) - weight.double()).abs() <= scale.double()[:, None] / 2).all())


# --- decode_attention ---------------------------------------------------------------


def cache_views(
    num_rows: int, num_heads: int, length: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (R, H, D), and keys and values as the slot cache hands them out: the first
    ``length`` of 3 * length positions, so each head's (L, D) block is contiguous
    but rows and heads are strided."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, num_heads, head_dim, generator=generator)
    kv = torch.randn(2, num_rows, num_heads, 3 * length, head_dim, generator=generator)
    return q, kv[0, :, :, :length], kv[1, :, :, :length]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16"])
def test_decode_attention_matches_masked_sdpa(
    kernels: Kernels, head_dim: int, cache_dtype: str
) -> None:
    """Against SDPA in float32 over the same stored keys and values, widened."""
    q, keys, values = cache_views(num_rows=5, num_heads=3, length=40, head_dim=head_dim)
    keys, values = keys.to(getattr(torch, cache_dtype)), values.to(getattr(torch, cache_dtype))
    lengths = torch.tensor([40, 1, 17, 39, 2])
    visible = (torch.arange(40)[None, :] < lengths[:, None])[:, None, None, :]  # (R, 1, 1, L)
    expected = F.scaled_dot_product_attention(
        q[:, :, None], keys.float(), values.float(), attn_mask=visible
    )
    got = kernels.decode_attention(q, keys, values, lengths)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected[:, :, 0], rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_nothing_past_a_rows_length(kernels: Kernels) -> None:
    q, keys, values = cache_views(num_rows=2, num_heads=2, length=10, head_dim=16)
    lengths = torch.tensor([4, 10])
    before = kernels.decode_attention(q, keys, values, lengths)
    keys[0, :, 4:] = float("nan")
    values[0, :, 4:] = float("nan")
    torch.testing.assert_close(kernels.decode_attention(q, keys, values, lengths), before)


@pytest.mark.parametrize(
    ("lengths", "head_dim", "message"),
    [
        ([0, 3], 16, "outside 1..8"),
        ([9, 3], 16, "outside 1..8"),
        ([8, 3], 48, "head_dim must be"),
    ],
)
def test_decode_attention_rejects_what_it_cannot_compute(
    kernels: Kernels, lengths: list[int], head_dim: int, message: str
) -> None:
    q, keys, values = cache_views(num_rows=2, num_heads=2, length=8, head_dim=head_dim)
    with pytest.raises(RuntimeError, match=message):
        kernels.decode_attention(q, keys, values, torch.tensor(lengths))


@pytest.mark.skipif(
    not has_bfloat16_products(), reason="this CPU's oneDNN has no bfloat16 dot products"
)
@pytest.mark.parametrize("num_rows", [MAX_ROWS, 40])
def test_bfloat16_products_round_the_activations_and_sum_in_float32(num_rows: int) -> None:
    x, weight, bias = operands(num_rows, 64, 96)
    projection = Projection(weight, bias, "bfloat16", bfloat16_products=True)
    projection.decode_path = "onednn"
    assert projection.dense_weight.dtype == torch.bfloat16
    expected = (
        F.linear(x.bfloat16().double(), projection.stored_weight.double(), None).bfloat16().float()
        + bias
    )  # the product's sum is rounded once, to bfloat16
    y = projection(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=0, atol=float(expected.abs().max()) * 2**-8)


@pytest.mark.model
@pytest.mark.parametrize("mode", cpu_modes())
def test_a_cpu_engine_decodes_through_both_kernels_in_every_mode(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    force_kernels(monkeypatch)
    gpt2 = tiny_engine(capacity=2, mode=mode).gpt2
    assert gpt2.decode_attention is not None
    projections = [gpt2.lm_head]
    for layer in gpt2.layers:
        projections += [layer.attn, layer.proj, layer.fc, layer.out]
    assert all(projection.decode_path == "kernel" for projection in projections)
    stored = Precision.for_device(torch.device("cpu"), *MODES[mode]).weights
    assert {projection.stored_weight.dtype for projection in projections} == {
        getattr(torch, stored)
    }


def test_the_step_profile_puts_the_kernels_work_in_its_sections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`bench.ceiling`'s profile names each build's ops (minibatch_avx2::...) by
    what they do: attention and projections, not "other torch ops"."""
    from bench.step_profile import profile_steps
    from tests.model_fixtures import random_prompt, request

    force_kernels(monkeypatch)
    engine = tiny_engine(capacity=2)
    # Else attention runs through SDPA, which the profile names without the fix.
    assert engine.gpt2.decode_attention is not None, "the decode kernels are not built"
    rng = random.Random(0)
    engine.admit(
        [request(f"r{i}", random_prompt(rng, 8, 8), 20, ignore_eos=True) for i in range(2)]
    )
    engine.step()
    sections = profile_steps(engine, num_steps=2)
    assert sections.get("attention", 0) > 0
    assert sections.get("layer projections", 0) > 0 and sections.get("LM head", 0) > 0


def test_a_kernels_dir_that_cannot_be_written_is_named_not_a_traceback(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    built = subprocess.run(
        [sys.executable, "-m", "worker.model.kernels"],
        env={**os.environ, "KERNELS_DIR": str(not_a_directory)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 1
    assert "Traceback" not in built.stderr
    assert f"cannot build the decode kernels in {not_a_directory}/" in built.stderr
    assert "set KERNELS_DIR to a directory this user can write" in built.stderr
