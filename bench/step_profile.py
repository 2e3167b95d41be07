"""Where one decode step's time goes, by section, from torch.profiler.

Each torch op's own time (excluding its children) is put in one section by its
name and shapes; what the ops do not account for of an unprofiled step's median
wall time is per-step Python and dispatch overhead (the engine's bookkeeping, tensor
building, the op calls themselves). The profiler's own cost lands in the op
times, so that overhead is, if anything, understated.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from bench.engines import sync
from worker.engine.torch_engine import TorchEngine

OVERHEAD = "Python and dispatch overhead"


def _section(name: str, shapes: list[list[int]], vocab_size: int) -> str:
    op = name.removeprefix("aten::")
    if op in ("mkldnn_linear", "mkldnn::_linear_pointwise"):
        return "LM head" if shapes[1][:1] == [vocab_size] else "layer projections"
    if op.startswith("minibatch_") and op.endswith("::packed_linear"):
        # The weight in panels: (panels, in, columns), or (panels, in / 2, columns, 2).
        panels, _, columns = shapes[1][:3]
        return "LM head" if panels * columns >= vocab_size else "layer projections"
    if op in ("to_mkldnn", "_to_dense"):
        return "oneDNN layout conversions"
    if op in ("_to_copy", "copy_"):
        return "dtype conversions"
    # The kernels' ops are named for their build's instruction set (minibatch_avx2::...).
    is_kernel_attention = op.startswith("minibatch") and op.endswith("::decode_attention")
    if is_kernel_attention or "scaled_dot_product" in op or op in ("where", "le", "scalar_tensor"):
        return "attention"
    if op == "_index_put_impl_":
        return "KV cache writes"
    if op in ("native_layer_norm", "gelu", "add"):
        return "layer norm, GELU, residual"
    if op in ("argmax", "topk", "softmax", "multinomial"):
        return "sampling"
    if op == "index":
        return "embeddings and row gathers"
    return "other torch ops"


def median_step_s(engine: TorchEngine, num_steps: int) -> float:
    """The median wall time of ``num_steps`` engine steps."""
    times = []
    for _ in range(num_steps):
        sync(engine.device)
        started = time.perf_counter()
        engine.step()
        sync(engine.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def profile_steps(engine: TorchEngine, num_steps: int) -> dict[str, float]:
    """Milliseconds per step by section over ``num_steps`` steps of the engine's
    active sequences (they must have that many tokens left); largest first."""
    vocab_size = engine.gpt2.vocab_size
    wall_ms = median_step_s(engine, num_steps) * 1000

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(num_steps):
            engine.step()
    sections: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        section = _section(event.key, event.input_shapes, vocab_size)
        sections[section] += event.self_cpu_time_total / 1000 / num_steps
    sections[OVERHEAD] = max(0.0, wall_ms - sum(sections.values()))
    ordered = dict(sorted(sections.items(), key=lambda item: -item[1]))
    return {"step_ms": wall_ms, **ordered}
