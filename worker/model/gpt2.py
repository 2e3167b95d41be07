"""A batched GPT-2 forward over a loaded model's weights, on the slot KV cache.

Three entry points: `prefill` runs newcomers' prompts (whole, or the next chunk
of each) into their slots and returns logits at each one's last position only,
and can take a decode step's rows in the same pass (`DecodeRows`);
`decode` feeds one token per slot at that slot's own position and attends to that
row's cached positions only; `replay` feeds a resumed sequence's streamed output
back into its slot through decode's forward, a token a row, so that its keys,
values and next logits are those the uninterrupted run decoded, bit for bit.

Every matrix product goes through `Projection`, which picks the kernel that is
fastest on this machine for the number of rows; on CPU, decode's attention runs in
this project's own kernel (`worker/model/kernels.py`). Weights, embeddings and the KV
cache are stored as `Precision` says, and activations are in its compute dtype.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GPT2LMHeadModel

from worker.model.cpu_isa import cpu_summary
from worker.model.kernels import HEAD_DIMS, load_kernels
from worker.model.kv_cache import SlotKVCache
from worker.model.precision import Precision
from worker.model.weights import Layer, layer_of, projection

TokenAttention = Callable[[Tensor, Tensor, Tensor], Tensor]
# A decode step's cached keys and values for a layer: (R, H, L, D) each.
CachedKeys = Callable[[int], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class DecodeRows:
    """A decode step to run in a prefill's pass (`GPT2.prefill`): one token per
    slot 0..R-1 at its position, attending to ``attend_len`` positions at most,
    as `GPT2.decode` takes them; logits are wanted for the slots ``wanted``."""

    token_ids: Tensor  # (R,)
    positions: Tensor  # (R,)
    attend_len: int
    wanted: list[int]


def _first_rows(cache: SlotKVCache, num_rows: int, length: int) -> CachedKeys:
    """Each layer's cached keys and values of slots 0..num_rows-1, positions
    0..length-1: a decode step's rows."""

    def cached(layer: int) -> tuple[Tensor, Tensor]:
        return cache.read(layer, num_rows, length)

    return cached


def _one_slot(cache: SlotKVCache, slot: int, num_rows: int, length: int) -> CachedKeys:
    """Each layer's cached keys and values of ``slot``'s positions 0..length-1, as
    the same view for each of ``num_rows`` rows."""

    def cached(layer: int) -> tuple[Tensor, Tensor]:
        keys, values = cache.read_slot(layer, slot, length)  # (1, H, L, D) each
        return keys.expand(num_rows, -1, -1, -1), values.expand(num_rows, -1, -1, -1)

    return cached


class GPT2:
    def __init__(self, model: GPT2LMHeadModel, precision: Precision) -> None:
        """``model``'s parameters must be in ``precision.compute``."""
        config = model.config
        self.precision = precision
        self.num_layers: int = config.n_layer
        self.num_heads: int = config.n_head
        self.width: int = config.n_embd
        self.head_dim = self.width // self.num_heads
        self.context_window: int = config.n_positions
        self.eps: float = config.layer_norm_epsilon
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported GPT-2 activation {config.activation_function!r}")
        body = model.transformer
        self.wte = body.wte.weight.detach().to(precision.storage)  # (V, C)
        self.wpe = body.wpe.weight.detach().to(precision.storage)  # (context, C)
        self.ln_f = (body.ln_f.weight.detach(), body.ln_f.bias.detach())
        self.vocab_size = int(model.lm_head.weight.shape[0])
        self.lm_head = projection(model.lm_head.weight, None, precision)  # C -> V
        self.layers = [layer_of(block, precision) for block in body.h]
        self.kernels = (
            load_kernels()
            if self.device.type == "cpu" and precision.compute == torch.float32
            else None
        )
        self.decode_attention = (
            self.kernels.decode_attention
            if self.kernels is not None and self.head_dim in HEAD_DIMS
            else None
        )
        # Made once: every step's row and position indices are slices of it.
        self.counting = torch.arange(self.context_window, device=self.device)

    def describe_kernels(self) -> str:
        """Which kernels decode runs on, for logs and /health."""
        if self.device.type != "cpu":
            return f"on {self.device}"
        projections = [self.lm_head]
        for layer in self.layers:
            projections += [layer.attn, layer.proj, layer.fc, layer.out]
        paths = collections.Counter(projection.decode_path for projection in projections)
        products = ", ".join(f"{count} on {path}" for path, count in sorted(paths.items()))
        kernels = "no decode kernels" if self.kernels is None else self.kernels.describe()
        threads = torch.get_num_threads()  # NUM_WORKERS share the cores (TORCH_THREADS)
        return (
            f"{kernels}; decode products {products}; CPU {cpu_summary()}, "
            f"{threads} thread{'s' if threads > 1 else ''}"
        )

    @property
    def device(self) -> torch.device:
        return self.wte.device

    def new_cache(self, num_slots: int) -> SlotKVCache:
        if num_slots > len(self.counting):  # decode's row indices come from it too
            self.counting = torch.arange(num_slots, device=self.device)
        return SlotKVCache(
            self.num_layers,
            num_slots,
            self.num_heads,
            self.context_window,
            self.head_dim,
            self.precision.storage,
            self.device,
        )

    # prefill
    def prefill(
        self,
        token_ids: torch.Tensor,
        lengths: list[int],
        slots: list[int],
        cache: SlotKVCache,
        keep_all: Collection[int] = (),
        starts: list[int] | None = None,
        *,
        block: int,
        beside: DecodeRows | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Newcomers' prompts packed end to end in ``token_ids`` (S,), ``lengths[i]``
        tokens for cache slot ``slots[i]`` at positions ``starts[i]`` onwards (0 by
        default: a whole prompt; more: the next chunk of a prompt whose earlier
        positions are in the cache already); returns (B, V) logits at each one's
        last position, and for each i in ``keep_all`` (in order) the final hidden
        state (L_i, C) of every position, for `logits` to score the prompt.

        Packing instead of padding to the longest prompt means every projection
        runs on real tokens only; attention runs per prompt, so prompts never see
        each other, and in aligned blocks of ``block`` positions
        (`_attend_prompts`), so a prompt's keys are the same however its chunks
        fall. Only a prompt's last position feeds its logits, so the last layer
        computes keys and values for every position (the cache needs them) but
        attention output and MLP for the last positions alone, except for the
        prompts in ``keep_all``. A chunk that starts past position 0 must start
        on a multiple of ``block``.

        With ``beside``, a decode step of those rows goes through the same pass,
        after the prompts' rows in every product, so that the weights are read
        once for both; the logits are then (B + W, V), the wanted rows' last.
        A row's products do not depend on its batchmates (`Projection`) and
        its attention is decode's, so those rows' logits, keys and values are
        `decode`'s, bit for bit."""
        starts = starts or [0] * len(lengths)
        ends = itertools.accumulate(lengths)
        spans = [(end - length, end) for end, length in zip(ends, lengths, strict=True)]
        kept = [
            (start, end) if i in keep_all else (end - 1, end)
            for i, (start, end) in enumerate(spans)
        ]
        positions = torch.cat(
            [
                self.counting[start : start + length]
                for start, length in zip(starts, lengths, strict=True)
            ]
        )
        x = self._embed(token_ids, positions)  # (S, C)
        num_decode_rows = 0
        if beside is not None:
            num_decode_rows = len(beside.token_ids)
            x = torch.cat([x, self._embed(beside.token_ids, beside.positions)])  # (S + R, C)
            decode_rows = self.counting[:num_decode_rows]
            attend = self._token_attention(beside.positions, beside.attend_len)
            cached_rows = _first_rows(cache, num_decode_rows, beside.attend_len)
        for index, layer in enumerate(self.layers):
            is_last_layer = index == self.num_layers - 1
            h = F.layer_norm(x, (self.width,), *layer.ln_1, self.eps)
            qkv = layer.attn(h)
            num_prompt_rows = len(qkv) - num_decode_rows
            decoded: list[Tensor] = []  # the decode rows' attention, (R, C) or (W, C)
            if beside is not None:
                # Before the prompts' keys go in: a row for a slot that is not
                # decoding writes a dummy where this pass's chunk of that slot may
                # start (`SlotEngine._scratch_position`), which the chunk then
                # overwrites.
                attended = self._attend_rows(
                    index,
                    qkv[num_prompt_rows:, None],  # (R, 1, 3C)
                    decode_rows,
                    beside.positions,
                    cache,
                    cached_rows,
                    attend,
                )[:, 0]
                decoded.append(attended[beside.wanted] if is_last_layer else attended)
            q, k, v = self._split_heads(qkv[:num_prompt_rows][None])  # 3 x (1, H, S, D)
            for slot, (begin, end), start in zip(slots, spans, starts, strict=True):
                cache.write_prompt(index, slot, k[0, :, begin:end], v[0, :, begin:end], start)
            attn = self._attend_prompts(
                q,
                k,
                v,
                spans,
                kept if is_last_layer else spans,
                (index, slots, starts, cache, block),
            )
            if is_last_layer:
                rows = [p for start, end in kept for p in range(start, end)]
                rows += [num_prompt_rows + slot for slot in beside.wanted] if beside else []
                x = x[rows]  # (K [+ W], C)
            if decoded:
                attn = torch.cat([attn, *decoded])
            x = x + layer.proj(attn)
            x = x + self._mlp(x, layer)
        ends_kept = list(itertools.accumulate(end - start for start, end in kept))
        hidden = [x[ends_kept[i] - lengths[i] : ends_kept[i]] for i in sorted(keep_all)]
        last = [end - 1 for end in ends_kept]
        if beside is not None:
            last += range(ends_kept[-1], ends_kept[-1] + len(beside.wanted))
        return self.logits(x[last]), hidden

    def _attend_prompts(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spans: list[tuple[int, int]],
        queries: list[tuple[int, int]],
        cached: tuple[int, list[int], list[int], SlotKVCache, int],
    ) -> torch.Tensor:
        """Causal attention within each prompt's span of the packed (1, H, S, D)
        q, k, v, for the query positions ``queries[i]`` (a tail of span i: all of
        it, or its last position); returns (Q, C). ``cached``: this layer, each
        span's slot and start position, the cache, and the block.

        SDPA's last bits depend on which queries share a call and on how many
        keys it reads, so the queries go in aligned blocks of ``block``
        positions, each block's in a call of its own against the keys up to its
        end, whatever the chunk around them: a block's keys for the next layer,
        and so the cache's rows, are then those of any other split of the
        prompt. The first block attends to its own keys; later ones read every
        earlier position from the cache, where this chunk's are already."""
        layer, slots, starts, cache, block = cached
        outputs = []
        for (begin, _), (first, last), slot, start in zip(
            spans, queries, slots, starts, strict=True
        ):
            offset = start - begin  # position p is at packed index p - offset
            for position, block_end in _aligned_blocks(first + offset, last + offset, block):
                query = q[..., position - offset : block_end - offset, :]
                if position < block:
                    # The first block: its chunk starts at 0, so ``k`` holds its keys.
                    keys = k[..., begin : begin + block_end, :]
                    values = v[..., begin : begin + block_end, :]
                    causal = block_end - position > 1
                    outputs.append(
                        F.scaled_dot_product_attention(query, keys, values, is_causal=causal)
                    )
                else:
                    cached_rows = cache.read_slot(layer, slot, block_end)
                    outputs.append(self._attend_to_cache(query, position, *cached_rows))
        return self._merge_heads(torch.cat(outputs, dim=2))[0]

    def _attend_to_cache(
        self, query: torch.Tensor, first: int, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """SDPA of the (1, H, Q, D) queries at positions first.. against a slot's
        cached keys and values (1, H, L, D) of positions 0..L-1, each query seeing
        the keys up to its own position."""
        keys, values = keys.to(query.dtype), values.to(query.dtype)  # the cache may be narrower
        query_positions = self.counting[first : first + query.shape[2]]
        visible = self.counting[: keys.shape[2]][None, :] <= query_positions[:, None]  # (Q, L)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible)

    # decode
    def decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend_len: int,
        cache: SlotKVCache,
    ) -> torch.Tensor:
        """One token per slot 0..R-1 (``token_ids``, ``positions``: (R,)); returns (R, V)
        logits. Row r attends to its own cache positions 0..positions[r] only."""
        num_rows = token_ids.shape[0]
        hidden = self._decode_rows(
            token_ids,
            positions,
            attend_len,
            cache,
            self.counting[:num_rows],
            _first_rows(cache, num_rows, attend_len),
        )
        return self.logits(hidden)

    def replay(
        self, token_ids: torch.Tensor, start: int, slot: int, cache: SlotKVCache
    ) -> torch.Tensor:
        """Feed ``token_ids`` (N,) into ``slot`` at positions start.. onwards, its
        earlier positions being in the cache, as decode steps fed them when they
        were drawn: each a row of decode's forward, attending as decode's rows do,
        its products those a decode step gives a row. Their keys and values, and
        the (V,) logits after the last, are then those decode computed, where
        prefill's differ in their last bits (other kernels, other summation
        orders); so a resumed sequence's output goes back into its slot this way,
        and it draws next exactly what the uninterrupted run drew."""
        num_rows = len(token_ids)
        length = start + num_rows
        hidden = self._decode_rows(
            token_ids,
            self.counting[start:length],
            length,
            cache,
            self.counting[slot : slot + 1].expand(num_rows),
            _one_slot(cache, slot, num_rows, length),
        )
        return self.logits(hidden[-1:])[0]

    def _decode_rows(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend_len: int,
        cache: SlotKVCache,
        rows: torch.Tensor,
        cached: CachedKeys,
    ) -> torch.Tensor:
        """Decode's forward: row r feeds ``token_ids[r]`` at ``positions[r]`` of
        cache slot ``rows[r]``, whose keys and values for each layer ``cached``
        gives (after this step's are written); returns the (R, C) final hidden
        states."""
        x = self._embed(token_ids, positions).unsqueeze(1)  # (R, 1, C)
        attend = self._token_attention(positions, attend_len)
        for index, layer in enumerate(self.layers):
            h = F.layer_norm(x, (self.width,), *layer.ln_1, self.eps)
            attn = self._attend_rows(index, layer.attn(h), rows, positions, cache, cached, attend)
            x = x + layer.proj(attn)
            x = x + self._mlp(x, layer)
        return x[:, 0]

    def _attend_rows(
        self,
        layer: int,
        qkv: Tensor,
        rows: Tensor,
        positions: Tensor,
        cache: SlotKVCache,
        cached: CachedKeys,
        attend: TokenAttention,
    ) -> Tensor:
        """Decode's attention in ``layer`` for its rows' (R, 1, 3C) queries, keys
        and values: writes each row's key and value at ``positions[r]`` of slot
        ``rows[r]``, then attends to what ``cached`` gives; returns (R, 1, C)."""
        q, k, v = self._split_heads(qkv)  # (R, H, 1, D)
        cache.write_tokens(layer, rows, positions, k[:, :, 0], v[:, :, 0])
        keys, values = cached(layer)  # (R, H, L, D)
        return attend(q, keys, values)

    def _token_attention(self, positions: torch.Tensor, attend_len: int) -> TokenAttention:
        """Attention for decode's one query per row, (R, H, 1, D) against the
        cached (R, H, L, D), returning (R, 1, C): row r sees positions
        0..positions[r] only. The CPU kernel reads each row's own keys alone;
        SDPA masks every row up to the longest."""
        kernel = self.decode_attention
        if kernel is not None:
            lengths = positions + 1

            def attend_with_kernel(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
                return kernel(q[:, :, 0], keys, values, lengths).view(-1, 1, self.width)

            return attend_with_kernel
        key_positions = self.counting[:attend_len]
        # (R, 1, 1, L): True where the key is at or before the row's own position.
        visible = (key_positions[None, :] <= positions[:, None])[:, None, None, :]

        def attend_with_sdpa(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
            # SDPA takes one dtype: a cache stored narrower is widened (a copy).
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
            return self._merge_heads(attn)

        return attend_with_sdpa

    # --- pieces -------------------------------------------------------------------

    def _embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        compute = self.precision.compute
        return self.wte[token_ids].to(compute) + self.wpe[positions].to(compute)  # (N, C)

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = qkv.shape
        # (B, T, 3C) -> 3 x (B, H, T, D)
        parts = qkv.view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return parts[0], parts[1], parts[2]

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(batch, length, self.width)  # (B, T, C)

    def _mlp(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        h = F.layer_norm(x, (self.width,), *layer.ln_2, self.eps)
        h = F.gelu(layer.fc(h), approximate="tanh")  # (B, T, 4C)
        return layer.out(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of final hidden states (B, C)."""
        h = F.layer_norm(hidden, (self.width,), *self.ln_f, self.eps)  # (B, C)
        return self.lm_head(h)  # (B, V)


def _aligned_blocks(start: int, end: int, block: int) -> Iterator[tuple[int, int]]:
    """Positions [start, end) cut at the multiples of ``block``, as (start, end) pairs."""
    while start < end:
        cut = min((start // block + 1) * block, end)
        yield start, cut
        start = cut
