"""The decode step's CPU kernels (``csrc/``), built once per instruction set and
loaded for the best one this CPU runs.

``packed_linear`` is the matrix product for 1 to 8 rows, on a weight packed once
by ``pack_weight`` into the build's panels (``csrc/skinny_linear.cpp``), and
``decode_attention`` one new token per row against that row's cached keys and
values. Both read weights or cache stored in float32, float16 or bfloat16 (and
``packed_linear`` int8, multiplied in integers where the ISA has them) and compute
in float32.

``python -m worker.model.kernels`` (run by ``make install`` and the worker image's
build) compiles one library per ISA in ``ISAS`` that this compiler targets, into
``KERNELS_DIR`` (default ``~/.cache/minibatch-llm/kernels``), in a directory named
after the torch version and a digest of the sources and flags: any checkout or
container with the same sources loads the same build. A worker never compiles.
It loads the library for ``chosen_isa()``: the best of ``ISAS`` that this CPU
reports (``/proc/cpuinfo``), or ``KERNEL_ISA`` where that is set (to compare
builds on one machine; an ISA this CPU cannot run is refused with what to set).
Where no library was built, the worker says so and decode runs on oneDNN and SDPA,
slower.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.cpu_isa import ISAS, chosen_isa, cpu_summary

# Named, not __name__: run as python -m, this module is __main__ to the log.
logger = logging.getLogger("worker.model.kernels")

SOURCE_DIRECTORY = Path(__file__).with_name("csrc")
SOURCES = ("skinny_linear.cpp", "decode_attention.cpp")
# The kernels' limits; the C++ checks them too.
MAX_ROWS = 8  # skinny_linear's rows in a decode step's tiles; more go in row groups
LANES = 32  # skinny_linear's in_features must be a multiple of this
HEAD_DIMS = (16, 32, 64, 128)  # decode_attention's head_dim

# Multiply-adds are fused (ISO C++ mode would keep them apart).
_COMMON_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=fast", "-fPIC", "-fopenmp", "-DNDEBUG"]


@dataclass(frozen=True)
class Kernels:
    isa: str  # the ISA of the build loaded, a key of ISAS
    int8_products: str  # "vnni", "integer" (vpmaddwd) or "float" (widened)
    # weight (out, in) -> the same weight in this build's panels, for packed_linear.
    pack_weight: Callable[[torch.Tensor], torch.Tensor]
    # (x (M, in), packed, out, scale (out,) | None, bias (out,) | None) -> (M, out);
    # y = (x @ weight.T) * scale + bias, with x, scale, bias and y float32.
    packed_linear: Callable[
        [torch.Tensor, torch.Tensor, int, torch.Tensor | None, torch.Tensor | None],
        torch.Tensor,
    ]
    # (q (R, H, D), keys (R, H, L, D), values (R, H, L, D), lengths (R,)) -> (R, H, D)
    decode_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
    ]

    def describe(self) -> str:
        return f"{self.isa} kernels, int8 products {self.int8_products}"

    def skinny_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``packed_linear`` on ``weight`` (out, in) packed for this one call; a
        weight used more than once is packed once (see Projection)."""
        return self.packed_linear(x, self.pack_weight(weight), weight.shape[0], scale, bias)


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """A weight packed by ``Kernels.pack_weight`` in its natural (out, in) layout
    again (a copy): float panels (P, in, C), int8 ones (P, in / 2, C, 2)."""
    if packed.dim() == 4:  # int8 column pairs
        panels, pairs, columns, _ = packed.shape
        natural = packed.permute(0, 2, 1, 3).reshape(panels * columns, pairs * 2)
    else:
        panels, in_features, columns = packed.shape
        natural = packed.permute(0, 2, 1).reshape(panels * columns, in_features)
    return natural[:out_features].contiguous()


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def build_directory() -> Path:
    """One directory per torch version, compiler and version of the sources and
    flags, wherever the sources sit, so that any checkout or container with the
    same sources loads the same build and different versions never mix."""
    root = Path(os.environ.get("KERNELS_DIR", "~/.cache/minibatch-llm/kernels")).expanduser()
    digest = hashlib.sha256()
    for source in sorted(SOURCE_DIRECTORY.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode() + source.read_bytes())
    flags = {isa: isa_flags for isa, (isa_flags, _) in ISAS.items()}
    digest.update(repr((flags, _COMMON_FLAGS, _compiler())).encode())
    return root / f"torch{torch.__version__}-{digest.hexdigest()[:16]}"


def library_path(isa: str) -> Path:
    return build_directory() / f"minibatch_kernels_{isa}.so"


def _compile_commands(isa: str, out: Path) -> list[list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths

    flags, _ = ISAS[isa]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-isystem{path}" for path in include_paths()]
    defines = [abi, f"-DMINIBATCH_OPS=minibatch_{isa}"]
    objects = [out / f"{Path(source).stem}_{isa}.o" for source in SOURCES]
    compile_flags = [*_COMMON_FLAGS, *flags, *defines, *includes]
    commands = [
        [_compiler(), *compile_flags, "-c", str(SOURCE_DIRECTORY / source), "-o", str(obj)]
        for source, obj in zip(SOURCES, objects, strict=True)
    ]
    [torch_lib] = library_paths()
    link = [_compiler(), "-shared", "-fopenmp", *map(str, objects), f"-L{torch_lib}"]
    link += ["-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    return [*commands, [*link, "-o", str(out / library_path(isa).name)]]


def buildable_isas() -> list[str]:
    """Every one of ISAS this machine's architecture has."""
    return list(ISAS) if platform.machine() == "x86_64" else ["baseline"]


def build(isas: list[str] | None = None, jobs: int | None = None) -> Path:
    """Compile the libraries for ``isas`` (default `buildable_isas`) into
    ``build_directory()``. The build happens in a scratch directory that is renamed
    into place whole, so a killed build leaves nothing half-written behind."""
    directory = build_directory()
    isas = buildable_isas() if isas is None else isas
    todo = [isa for isa in isas if _damage(isa) is not None]
    if not todo:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent) as scratch:
        out = Path(scratch)
        plans = {isa: _compile_commands(isa, out) for isa in todo}
        with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            try:
                compiled = [
                    pool.submit(subprocess.run, command, check=True, capture_output=True, text=True)
                    for plan in plans.values()
                    for command in plan[:-1]
                ]
                for future in compiled:
                    _raise_with_output(future)
                for plan in plans.values():
                    _raise_with_output(
                        pool.submit(
                            subprocess.run, plan[-1], check=True, capture_output=True, text=True
                        )
                    )
            except BaseException:
                # A failed compile, or ^C: start none of the compiles still queued
                # (leaving the pool waits for them, a minute on 2 cores).
                pool.shutdown(cancel_futures=True)
                raise
        for isa in todo:
            target = library_path(isa)
            if target.is_symlink():  # replaced, not followed
                target.unlink()
            elif target.is_dir():  # what a damaged build left: replaced whole
                shutil.rmtree(target)
            os.replace(out / library_path(isa).name, library_path(isa))
    return directory


def _say_decode_is_slower(why: str, damaged: Path | str) -> None:
    """Warn that the worker serves without its decode kernels, and say how to
    build them: the command as this worker would find what it builds (KERNELS_DIR
    and CXX each choose the directory), after removing a ``damaged`` library."""
    kernels_dir = os.environ.get("KERNELS_DIR")
    setting = f"KERNELS_DIR={shlex.quote(kernels_dir)} " if kernels_dir else ""
    remove = ""
    if damaged:
        recursive = "-r " if Path(damaged).is_dir() else ""
        remove = f"rm {recursive}{shlex.quote(str(damaged))} && "
    logger.warning(
        "%s, so decode runs on oneDNN and SDPA, slower; build them with `%s%sCXX=%s %s -m "
        "worker.model.kernels` (make install builds them in the default KERNELS_DIR when "
        "it sets up .venv, and again when their sources change)",
        why,
        remove,
        setting,
        shlex.quote(_compiler()),
        sys.executable,
    )


def _damage(isa: str) -> str | None:
    """What is wrong with the library built for ``isa``, if anything (its absence
    included): only a whole library of that build is loaded, or skipped as built."""
    path = library_path(isa)
    if not path.exists():
        return f"no decode kernels are built for {isa} at {path.parent}"
    if path.is_dir():
        return f"{path} is a directory, not the decode kernels' library"
    if not is_whole_library(path):
        return f"the decode kernels at {path} are damaged (cut short, or no library)"
    # Another build's library under this name registers its own ops, and may run
    # instructions this CPU lacks as it loads.
    if f"minibatch_{isa}\0".encode() not in path.read_bytes():
        return f"the library at {path} is not the {isa} build of the decode kernels"
    return None


def is_whole_library(path: Path) -> bool:
    """Whether ``path`` is a 64-bit ELF library with every byte its header counts
    (the section headers come last). One cut short (a copy that ran out of disk)
    is mapped by the loader, then faults (SIGBUS) with nothing said."""
    try:
        with path.open("rb") as library:
            header = library.read(64)
            size = os.fstat(library.fileno()).st_size
    except OSError:
        return False
    if len(header) < 64 or header[:5] != b"\x7fELF\x02":
        return False
    order: typing.Literal["little", "big"] = "little" if header[5] == 1 else "big"
    section_headers = int.from_bytes(header[0x28:0x30], order)
    entry_bytes = int.from_bytes(header[0x3A:0x3C], order)
    num_entries = int.from_bytes(header[0x3C:0x3E], order)
    return size >= section_headers + entry_bytes * num_entries


def _raise_with_output(future: concurrent.futures.Future[subprocess.CompletedProcess[str]]) -> None:
    try:
        future.result()
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"{' '.join(error.cmd[:3])} ... failed:\n{error.stderr}") from error


def load_kernels(isa: str | None = None) -> Kernels | None:
    """The kernels built for ``isa`` (default ``chosen_isa()``), for tensors on the
    CPU; None, logged once, where that library was never built."""
    return _load(isa or chosen_isa())


@functools.cache
def _load(isa: str) -> Kernels | None:
    path = library_path(isa)
    damage = _damage(isa)
    if damage is not None:  # the loader could fault on it (SIGBUS), with nothing said
        _say_decode_is_slower(damage, path if path.exists() else "")
        return None
    try:
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
        ops = getattr(torch.ops, f"minibatch_{isa}")
        kernels = Kernels(
            isa=isa,
            int8_products=ops.int8_products(),
            pack_weight=ops.pack_weight,
            packed_linear=ops.packed_linear,
            decode_attention=ops.decode_attention,
        )
    except (OSError, AttributeError, RuntimeError) as exc:
        _say_decode_is_slower(f"the decode kernels at {path} do not load ({exc})", path)
        return None
    logger.info("decode kernels: %s on %s", kernels.describe(), cpu_summary())
    return kernels


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if shutil.which(_compiler()) is None:
        sys.exit(f"no C++ compiler ({_compiler()}) to build the decode kernels with: install g++")
    started = time.monotonic()
    isas = buildable_isas()
    were_built = all(_damage(isa) is None for isa in isas)
    if not were_built:  # else the only output is the last line, a minute or two later
        logger.info("building the decode kernels for %s, once (a minute or two)", ", ".join(isas))
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):  # cleaned up after as after a ^C
        signal.signal(stop_signal, _interrupt)
    try:
        directory = build(isas)
    except KeyboardInterrupt as stop:
        logger.info("the decode kernels' build was interrupted; nothing of it was kept")
        sys.exit(128 + (stop.args[0] if stop.args else signal.SIGINT))
    except OSError as exc:  # not a directory, read-only, no space left
        sys.exit(
            f"cannot build the decode kernels in {build_directory()} ({exc}): set "
            "KERNELS_DIR to a directory this user can write"
        )
    done = "were built before" if were_built else f"built in {time.monotonic() - started:.1f} s"
    logger.info(
        "decode kernels for %s %s, in %s; this CPU runs %s",
        ", ".join(isas),
        done,
        directory,
        chosen_isa(),
    )


def _interrupt(signum: int, _: object) -> None:
    raise KeyboardInterrupt(signum)


if __name__ == "__main__":
    main()
