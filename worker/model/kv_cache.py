"""The slot KV cache: one tensor, allocated once, that sequences write in place.

A sequence owns slot ``s`` from admit to evict. Its key and value for the token at
position ``p`` of layer ``l`` live at ``kv[l, 0 or 1, s, :, p]`` and are written
exactly once; nothing is copied, moved or re-padded afterwards. Positions past a
sequence's length may hold stale data from an earlier owner; attention reads
each row only up to its own length, so it is never used. The cache may be stored
in fewer bytes than the model computes in; writes round into it.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        context_window: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # (layers, {K,V}, slots, heads, context, head_dim)
        self.kv = torch.zeros(
            num_layers,
            2,
            num_slots,
            num_heads,
            context_window,
            head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def nbytes_for(
        num_layers: int, num_slots: int, context_window: int, hidden_size: int, dtype: torch.dtype
    ) -> int:
        """The bytes of a cache of this shape (heads x head_dim is the hidden size)."""
        return num_layers * 2 * num_slots * context_window * hidden_size * dtype.itemsize

    def describe(self) -> str:
        layers, _, slots, heads, context, head_dim = self.kv.shape
        return (
            f"KV cache {self.nbytes / 2**20:,.1f} MiB on {self.kv.device} ({self.kv.dtype}): "
            f"{layers} layers x {{K,V}} x {slots} slots x {heads} heads x {context} positions "
            f"x {head_dim} head_dim"
        )

    def write_prompt(
        self, layer: int, slot: int, keys: torch.Tensor, values: torch.Tensor, start: int = 0
    ) -> None:
        """Store a prompt's keys/values (heads, T, head_dim), or a chunk of one, at
        positions start..start+T-1."""
        end = start + keys.shape[1]
        self.kv[layer, 0, slot, :, start:end] = keys  # copy_ rounds to the cache's dtype
        self.kv[layer, 1, slot, :, start:end] = values

    def read_slot(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of one slot's positions 0..length-1: keys and values,
        each (1, heads, length, head_dim)."""
        kv = self.kv[layer, :, slot : slot + 1, :, :length]
        return kv[0], kv[1]

    def write_tokens(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store one token for each slot in ``rows`` at that row's position in
        ``positions`` (both (R,)); keys and values are (R, heads, head_dim)."""
        # index_put_ does not convert: round to the cache's dtype first.
        self.kv[layer, 0, rows, :, positions] = keys.to(self.kv.dtype)
        self.kv[layer, 1, rows, :, positions] = values.to(self.kv.dtype)

    def read(self, layer: int, num_rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of slots 0..num_rows-1, positions 0..length-1:
        keys and values, each (rows, heads, length, head_dim)."""
        return self.kv[layer, 0, :num_rows, :, :length], self.kv[layer, 1, :num_rows, :, :length]
