"""Small host values onto the device without the host waiting for the device.

A copy from ordinary (pageable) host memory to a CUDA device first waits for
everything queued on the stream, so each such copy in a step would stall the
host once more. A copy from page-locked memory is queued like a kernel instead.
PyTorch keeps freed page-locked blocks for reuse, and reuses one only once the
copy out of it is done, so a short-lived page-locked tensor per copy is cheap
and safe. On the CPU this is plain `torch.tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
