"""The decode step's matrix-product kernel (``csrc/skinny_linear.cpp``), compiled
by torch's extension builder on first use and kept under ``TORCH_EXTENSIONS_DIR``
(by default ``~/.cache/torch_extensions``), one build per torch version.

``make install`` builds it ahead (``python -m worker.skinny_linear``), so a worker
does not spend its first start compiling (about 12 s on 2 cores); later starts
load the built library in a tenth of a second. Where it cannot be built (no C++
compiler), the worker logs why and decode runs on oneDNN, about a third slower.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "skinny_linear.cpp"
# The kernel's limits; csrc/skinny_linear.cpp checks them too.
MAX_ROWS = 8
LANES = 16

SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def build_directory() -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions"))
    return root.expanduser() / f"minibatch_skinny_linear-torch{torch.__version__}"


@functools.cache
def load_skinny_linear() -> SkinnyLinear | None:
    """``skinny_linear(x, weight, bias)``: ``x @ weight.T + bias`` for 1 to
    ``MAX_ROWS`` float32 rows on the CPU; None where it cannot be built."""
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
                name="minibatch_skinny_linear",
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,  # the library registers torch.ops.minibatch
            )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning(
            "the decode kernel could not be built, so decode runs on oneDNN, about a third "
            "slower; install a C++ compiler (g++) to get it back. Cause: %s",
            error,
        )
        return None
    logger.info("decode kernel ready in %.1f s", time.monotonic() - started)
    kernel: SkinnyLinear = torch.ops.minibatch.skinny_linear
    return kernel


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load_skinny_linear() is None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
