"""Next-token choice for a batch that mixes greedy and sampled requests.

Greedy rows (temperature 0) take the argmax, and an all-greedy batch costs nothing
more. Sampled rows are scaled by their temperature, filtered by their top_k and
top_p, and drawn by Gumbel-max, all vectorised over the rows. Each sampled request
draws its noise from its own generator, seeded from its ``seed`` when it has one,
so a seeded request gives the same tokens whatever its batchmates.
"""

from __future__ import annotations

import torch

from protocol import ErrorCode, GenerateRequest
from worker.engine import RequestRejected


def check_sampling(request: GenerateRequest) -> None:
    """Reject sampling parameters no distribution can be built from."""
    problem = None
    if request.temperature < 0:
        problem = f"temperature must be >= 0, got {request.temperature}"
    elif not 0 < request.top_p <= 1:
        problem = f"top_p must be in (0, 1], got {request.top_p}"
    elif request.top_k < 0:
        problem = f"top_k must be >= 0 (0 turns it off), got {request.top_k}"
    if problem is not None:
        raise RequestRejected(request.request_id, ErrorCode.INVALID_REQUEST, problem)


def is_greedy(request: GenerateRequest) -> bool:
    return request.temperature == 0


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def generator_for(self, request: GenerateRequest) -> torch.Generator | None:
        """The request's own noise source; None for a greedy request."""
        if is_greedy(request):
            return None
        generator = torch.Generator(device=self.device)
        if request.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.seed)
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        requests: list[GenerateRequest],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One token per row of ``logits`` (N, V), row i for ``requests[i]``."""
        next_ids = logits.argmax(dim=-1)  # (N,)
        sampled = [i for i, generator in enumerate(generators) if generator is not None]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            chosen = self._draw(
                logits[rows].float(),
                [requests[i] for i in sampled],
                [generators[i] for i in sampled],
            )
            next_ids[rows] = chosen
        return [int(token_id) for token_id in next_ids.tolist()]

    def _draw(
        self,
        logits: torch.Tensor,
        requests: list[GenerateRequest],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        vocab_size = logits.shape[-1]  # logits: (S, V)
        device = logits.device
        temperature = torch.tensor([r.temperature for r in requests], device=device)
        scaled = logits / temperature[:, None]
        noise = torch.empty_like(scaled)  # (S, V) uniform, each row from its own generator
        for row, generator in enumerate(generators):
            noise[row].uniform_(generator=generator)
        # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
        gumbel = -torch.log(-torch.log(noise.clamp_(min=torch.finfo(noise.dtype).tiny)))
        top_k = torch.tensor([r.top_k for r in requests], device=device)
        top_p = torch.tensor([r.top_p for r in requests], device=device)
        if not bool(((top_k > 0) | (top_p < 1)).any()):
            return (scaled + gumbel).argmax(dim=-1)
        # Filter in descending order; the draw happens in that order too, so no
        # scatter back to vocabulary order is needed until the very end.
        ordered, order = scaled.sort(dim=-1, descending=True)  # (S, V)
        rank = torch.arange(vocab_size, device=device)
        keep_k = torch.where(top_k > 0, top_k, vocab_size)
        removed = rank[None, :] >= keep_k[:, None]
        ordered = ordered.masked_fill(removed, float("-inf"))
        probs = ordered.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always).
        mass_before = probs.cumsum(dim=-1) - probs
        removed = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
        ordered = ordered.masked_fill(removed, float("-inf"))
        choice = (ordered + gumbel).argmax(dim=-1, keepdim=True)  # (S, 1) ranks
        return order.gather(-1, choice)[:, 0]
