"""Next-token choice for a batch that mixes greedy and sampled requests.

A row's logit_bias is added first (`apply_logit_bias`, which the engine calls
before the penalties). Greedy rows (temperature 0) take the argmax, and an
all-greedy batch costs nothing more. Sampled rows are scaled by their
temperature, filtered by their top_k and top_p, and drawn by Gumbel-max, all
vectorised over the rows (min_p too: a token less likely than min_p times the
row's likeliest is not drawn, vLLM's rule). A sampled row's noise is a function of its request's
seed and the output position it draws, nothing else: a seeded request gives the
same tokens whatever its batchmates, and a stream resumed on another worker
draws what the interrupted one would have drawn.
"""

from __future__ import annotations

import secrets

import torch

from protocol import GenerateRequest
from protocol.limits import UNSEEDED
from worker.model.host_copy import to_device

# Below this a temperature is greedy: dividing logits by it overflows to NaN
# (vLLM's _SAMPLING_EPS).
_MIN_SAMPLING_TEMPERATURE = 1e-5
_UINT64 = (1 << 64) - 1


def is_greedy(request: GenerateRequest) -> bool:
    return request.temperature < _MIN_SAMPLING_TEMPERATURE


def noise_seed(seed: int, position: int) -> int:
    """The generator seed for output position ``position`` of a request seeded with
    ``seed``: splitmix64 of the pair, so that nearby seeds and positions give
    unrelated noise."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _UINT64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64
    return z ^ (z >> 31)


def apply_logit_bias(logits: torch.Tensor, requests: list[GenerateRequest]) -> None:
    """Add ``requests[i]``'s logit_bias to row i of ``logits`` (N, V), in place:
    one scatter-add over every biased row, and a batch with none costs one
    Python scan. The ids are in the vocabulary and distinct (the worker checked)."""
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, request in enumerate(requests):
        if request.logit_bias_token_ids:
            rows += [i] * len(request.logit_bias_token_ids)
            token_ids += request.logit_bias_token_ids
            values += request.logit_bias_values
    if rows:
        index = to_device([rows, token_ids], logits.device, torch.long)  # (2, K)
        bias = to_device(values, logits.device, logits.dtype)  # (K,)
        logits.index_put_((index[0], index[1]), bias, accumulate=True)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)

    def seed_for(self, request: GenerateRequest) -> int | None:
        """The seed a request samples with for its whole life; None if greedy. An
        unseeded request (no seed, or UNSEEDED) gets a random one."""
        if is_greedy(request):
            return None
        if request.seed is None or request.seed == UNSEEDED:
            return secrets.randbits(64)
        return request.seed

    def sample(
        self,
        logits: torch.Tensor,
        requests: list[GenerateRequest],
        seeds: list[int | None],
        positions: list[int],
    ) -> list[int]:
        """One token per row of ``logits`` (N, V), row i for ``requests[i]``, drawn
        with seed ``seeds[i]`` (None: greedy) at output position ``positions[i]``
        (the number of output tokens before it)."""
        next_ids = logits.argmax(dim=-1)  # (N,)
        sampled = [(i, seed) for i, seed in enumerate(seeds) if seed is not None]
        if sampled:
            rows = to_device([i for i, _ in sampled], logits.device)
            chosen = self._draw(
                logits[rows].float(),
                [requests[i] for i, _ in sampled],
                [noise_seed(seed, positions[i]) for i, seed in sampled],
            )
            next_ids[rows] = chosen
        return [int(token_id) for token_id in next_ids.tolist()]

    def _draw(
        self,
        logits: torch.Tensor,
        requests: list[GenerateRequest],
        noise_seeds: list[int],
    ) -> torch.Tensor:
        device = logits.device  # logits: (S, V)
        temperature = to_device([r.temperature for r in requests], device, torch.float32)
        scaled = logits / temperature[:, None]
        noise = torch.empty_like(scaled)  # (S, V) uniform, each row from its own seed
        for row, seed in enumerate(noise_seeds):
            noise[row].uniform_(generator=self._generator.manual_seed(seed))
        # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
        gumbel = -torch.log(-torch.log(noise.clamp_(min=torch.finfo(noise.dtype).tiny)))
        removed = self._removed(scaled, requests)
        if removed is None:
            return (scaled + gumbel).argmax(dim=-1)
        return (scaled.masked_fill(removed, float("-inf")) + gumbel).argmax(dim=-1)

    def _removed(
        self, scaled: torch.Tensor, requests: list[GenerateRequest]
    ) -> torch.Tensor | None:
        """Which tokens each row of ``scaled`` (S, V) may not draw, by its top_k,
        top_p and min_p; None when no row filters."""
        by_rank = self._removed_by_rank(scaled, requests)
        if not any(r.min_p > 0 for r in requests):
            return by_rank
        # min_p: p_i < min_p * p_max, that is logit_i < logit_max + log(min_p); the
        # likeliest token, which top_k and top_p keep too, always stays.
        min_p = to_device([r.min_p for r in requests], scaled.device, torch.float32)
        floor = scaled.max(dim=-1).values + min_p.log()  # -inf where min_p is 0
        by_ratio = scaled < floor[:, None]
        return by_ratio if by_rank is None else by_rank | by_ratio

    def _removed_by_rank(
        self, scaled: torch.Tensor, requests: list[GenerateRequest]
    ) -> torch.Tensor | None:
        if not any(r.top_k > 0 or r.top_p < 1 for r in requests):
            return None
        vocab_size = scaled.shape[-1]
        device = scaled.device
        top_k = to_device([r.top_k for r in requests], device)
        top_p = to_device([r.top_p for r in requests], device, torch.float32)
        # Which tokens each row keeps is found in descending order ...
        ordered, order = scaled.sort(dim=-1, descending=True)  # (S, V)
        rank = torch.arange(vocab_size, device=device)
        keep_k = torch.where(top_k > 0, top_k, vocab_size)
        removed = rank[None, :] >= keep_k[:, None]
        probs = ordered.masked_fill(removed, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p, and the top token
        # always: a top_p below float32's least number rounds to 0 here.
        mass_before = probs.cumsum(dim=-1) - probs
        removed[:, 1:] |= ((mass_before >= top_p[:, None]) & (top_p < 1)[:, None])[:, 1:]
        # ... and the draw is made in vocabulary order, as above: a row that
        # filters nothing draws what it would in a batch where no row filters.
        return torch.zeros_like(removed).scatter_(-1, order, removed)
