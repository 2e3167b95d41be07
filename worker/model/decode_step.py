"""Decode steps run from buffers made once: the hot loop, ready for a GPU.

A step's token ids, positions and wanted rows go into one host buffer made at
start (page-locked on CUDA), and on into one device buffer by a copy the host
does not wait for. So the only place a step's host waits for the device is where
the engine reads the sampled ids.

On CUDA each step replays a CUDA graph. One is captured at start for each bucket:
a few row counts by a few attended lengths, each step running in the smallest
bucket that holds it. A padding row decodes a dummy token at its slot's scratch
position (`SlotEngine._scratch_position`), and padding positions are masked off,
so padding changes no answer. A replay allocates nothing and builds no index:
the mask and every index come from the staged buffers and the model's own
`counting` range.

On the CPU the same code runs eagerly, each step at its own size: the decode
kernel reads each row's own keys, and padding would only add work that no graph
pays back. Tests run it on the CPU with the GPU's buckets, and with a stand-in
for capture that replays a step by running it again (`eager`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.model.gpt2 import GPT2
from worker.model.kv_cache import SlotKVCache

# A step, ready to run on what is staged: returns (rows, V) logits.
Replay = Callable[[], torch.Tensor]
# Turns a step into its replay: captures it in a CUDA graph, or (`eager`) keeps it.
Capture = Callable[[Replay], Replay]

# The shortest attended length a graph is captured at on CUDA; each longer
# bucket doubles it, up to the context window.
SHORTEST_GRAPH_LENGTH = 64


@dataclass(frozen=True)
class Buckets:
    """The row counts and attended lengths steps are captured at, each ascending;
    the largest of each must hold any step (the capacity, the context window)."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def doubling(cls, capacity: int, context_window: int, shortest_length: int) -> Buckets:
        """1, 2, 4 ... rows up to ``capacity``; ``shortest_length``, twice that ...
        positions up to ``context_window``."""
        return cls(
            _doubling(1, capacity), _doubling(min(shortest_length, context_window), context_window)
        )

    def rows_for(self, num_rows: int) -> int:
        return self.rows[bisect.bisect_left(self.rows, num_rows)]

    def length_for(self, length: int) -> int:
        return self.lengths[bisect.bisect_left(self.lengths, length)]


def _doubling(first: int, last: int) -> tuple[int, ...]:
    sizes = [first]
    while sizes[-1] * 2 < last:
        sizes.append(sizes[-1] * 2)
    return (*sizes, last) if sizes[-1] != last else tuple(sizes)


def eager(step: Replay) -> Replay:
    """The stand-in for capture: replaying runs the step again, on what is then
    staged, as a graph's replay would."""
    return step


def cuda_graph_capture(device: torch.device) -> Capture:
    """Captures each step into a CUDA graph. All captures share one memory pool and
    one stream (warm-up runs there too, so that lazily made library handles are
    made before capture, not during it); replays never overlap, so sharing is safe."""
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Replay) -> Replay:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    return capture


class DecodeStep:
    # Rows of the staging buffers.
    _TOKEN_IDS, _POSITIONS, _WANTED = range(3)

    def __init__(
        self,
        gpt2: GPT2,
        cache: SlotKVCache,
        capacity: int,
        graphs: tuple[Buckets, Capture] | None = None,
    ) -> None:
        """``graphs``: the buckets and how to capture a step at each; None runs each
        step eagerly at its own size. Capturing runs every bucket's step on the
        cache: build this while no slot holds a sequence."""
        self.gpt2 = gpt2
        self.cache = cache
        device = gpt2.device
        self._host = torch.zeros(3, capacity, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host_values = self._host.numpy()
        self._staged = torch.zeros(3, capacity, dtype=torch.long, device=device)
        # Set when the last copy out of the host buffer is done: on CUDA the buffer
        # is written again only then (in practice it always is: reading the sampled
        # ids waited for it).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.buckets: Buckets | None = None
        self._replays: dict[tuple[int, int], Replay] = {}
        self._logits: torch.Tensor | None = None
        if graphs is not None:
            self.buckets, capture = graphs
            # Each graph leaves its logits here, so that graphs share one output.
            self._logits = torch.empty(
                capacity, gpt2.vocab_size, dtype=gpt2.precision.compute, device=device
            )
            self._capture_all(self.buckets, capture)

    @torch.inference_mode()
    def _capture_all(self, buckets: Buckets, capture: Capture) -> None:
        # Largest first: the smaller graphs then fit in the memory the larger freed.
        for rows in reversed(buckets.rows):
            for length in reversed(buckets.lengths):
                self._replays[rows, length] = capture(self._graphed(rows, length))

    def rows_for(self, num_rows: int) -> int:
        """How many rows (slots 0..n-1) a step needing ``num_rows`` decodes."""
        return num_rows if self.buckets is None else self.buckets.rows_for(num_rows)

    def run(self, token_ids: list[int], positions: list[int], wanted: list[int]) -> torch.Tensor:
        """One token for each slot 0..R-1 (R = ``len(token_ids)``, which `rows_for`
        gave) at ``positions``; returns the (len(wanted), V) logits of the slots
        in ``wanted``, in that order. On CUDA they are the graph's own output,
        valid until the next step."""
        num_rows = len(token_ids)
        length = max(positions) + 1
        if self.buckets is not None:
            length = self.buckets.length_for(length)
        self._stage(token_ids, positions, wanted)
        replay = self._replays.get((num_rows, length))
        logits = replay() if replay is not None else self._decode(num_rows, length)
        if wanted == list(range(len(wanted))):
            return logits[: len(wanted)]
        return logits[self._staged[self._WANTED, : len(wanted)]]

    def _stage(self, token_ids: list[int], positions: list[int], wanted: list[int]) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        values = self._host_values
        values[self._TOKEN_IDS, : len(token_ids)] = token_ids
        values[self._POSITIONS, : len(positions)] = positions
        values[self._WANTED, : len(wanted)] = wanted
        self._staged.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _decode(self, num_rows: int, length: int) -> torch.Tensor:
        staged = self._staged[:, :num_rows]
        return self.gpt2.decode(
            staged[self._TOKEN_IDS], staged[self._POSITIONS], length, self.cache
        )

    def _graphed(self, num_rows: int, length: int) -> Replay:
        assert self._logits is not None
        logits = self._logits[:num_rows]

        def step() -> torch.Tensor:
            return logits.copy_(self._decode(num_rows, length))

        return step
