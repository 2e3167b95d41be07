"""The decode step's CPU kernels (``csrc/``): ``skinny_linear``, the matrix
product for 1 to 8 rows, and ``decode_attention``, one new token per row against
that row's cached keys and values. Both read weights or cache stored in float32,
float16 or bfloat16 (and ``skinny_linear`` int8) and compute in float32. They
are compiled by torch's extension builder on first use and kept under
``TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``), one build per
torch version and version of the sources.

``make install`` builds them ahead (``python -m worker.kernels``), so a worker does
not spend its first start compiling (about 15 s on 2 cores); later starts load
the built library in a tenth of a second. Where they cannot be built (no C++
compiler), the worker logs why and decode runs on oneDNN and SDPA, slower.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("skinny_linear.cpp", "decode_attention.cpp")
]
# The kernels' limits; the C++ checks them too.
MAX_ROWS = 8  # skinny_linear's rows
LANES = 16  # skinny_linear's in_features must be a multiple of this
HEAD_DIMS = (16, 32, 64, 128)  # decode_attention's head_dim


@dataclass(frozen=True)
class Kernels:
    # (x (M, in), weight (out, in), scale (out,) | None, bias (out,) | None) -> (M, out);
    # y = (x @ weight.T) * scale + bias, with x, scale, bias and y float32.
    skinny_linear: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor
    ]
    # (q (R, H, D), keys (R, H, L, D), values (R, H, L, D), lengths (R,)) -> (R, H, D)
    decode_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
    ]


def build_directory() -> Path:
    """One directory per torch version and version of the sources, so that checkouts
    of different versions on one machine never rebuild over each other's library."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions"))
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).with_name("csrc").iterdir()):
        digest.update(source.read_bytes())
    version = f"torch{torch.__version__}-{digest.hexdigest()[:12]}"
    return root.expanduser() / f"minibatch_kernels-{version}"


@functools.cache
def load_kernels() -> Kernels | None:
    """The kernels, for tensors on the CPU; None where they cannot be built."""
    from torch.utils.cpp_extension import load

    started = time.monotonic()
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # torch's builder marks a build in progress with a lock file that stays
        # behind if its process is killed mid-build, and every later start would
        # then wait on it forever: a worker can be killed at any time. Builds are
        # serialised under an flock instead, which the kernel releases when its
        # holder dies, and whoever holds it clears a leftover lock file first.
        with open(directory / "build.flock", "w") as build_lock:
            fcntl.flock(build_lock, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            load(
                name="minibatch_kernels",
                sources=[str(source) for source in SOURCES],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,  # the library registers torch.ops.minibatch
            )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning(
            "the decode kernels could not be built, so decode runs on oneDNN and SDPA, its steps "
            "about 40%% longer; install a C++ compiler (g++) to get them back. Cause: %s",
            error,
        )
        return None
    logger.info("decode kernels ready in %.1f s", time.monotonic() - started)
    ops = torch.ops.minibatch
    return Kernels(skinny_linear=ops.skinny_linear, decode_attention=ops.decode_attention)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load_kernels() is None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
