"""The torch engine: GPT-2 on the slot KV cache, behind the `InferenceEngine` seam.

`SlotEngine` keeps the slots and the finishing rules; this class only computes
tokens. Decode runs one row per slot from 0 to the highest slot in use: the cache
is then read as a view, never gathered, and a free slot inside that range costs
one wasted row, which is nearly free when a step is bound by reading the weights.
"""

from __future__ import annotations

import logging

import torch
from transformers import GPT2Config

from worker.engine.chat_template import ChatTemplate
from worker.engine.grammar import Grammars, hf_grammar_tokenizer
from worker.engine.interface import ModelInfo
from worker.engine.logprobs import TokenLogprob
from worker.engine.prefill_plan import Chunk
from worker.engine.prefix_cache import Match
from worker.engine.sequence import Sequence
from worker.engine.slot_engine import SlotEngine
from worker.model.decode_step import SHORTEST_GRAPH_LENGTH, Buckets, DecodeStep, cuda_graph_capture
from worker.model.gpt2 import GPT2, DecodeRows
from worker.model.host_copy import to_device
from worker.model.loader import LoadedModel
from worker.model.penalties import apply_penalties, suppress_early_stops
from worker.model.precision import Precision
from worker.model.projection import num_matmul_shapes
from worker.model.sampler import Sampler, apply_logit_bias
from worker.model.token_mask import apply_token_masks

logger = logging.getLogger(__name__)


# Prompt positions scored per LM-head call: 256 x 50257 float32 logits is 51 MB.
_PROMPT_SCORE_CHUNK = 256


class TorchEngine(SlotEngine):
    def __init__(
        self,
        loaded: LoadedModel,
        capacity: int,
        *,
        chat_template: ChatTemplate | None = None,
        precision: Precision | None = None,
        gpt2: GPT2 | None = None,
        prefill_chunk_tokens: int = 0,
        cuda_graphs: bool = True,
        prefix_cache: bool = True,
        block_tokens: int = 0,
    ) -> None:
        """``precision`` defaults to the loaded model's own dtype throughout;
        ``gpt2``, the model's weights already made into the engine's, to ``loaded``;
        ``prefill_chunk_tokens``, ``prefix_cache`` and ``block_tokens``: see
        `SlotEngine`; ``cuda_graphs``: on CUDA, decode steps replay graphs
        captured here (`worker.model.decode_step`)."""
        config = loaded.model.config
        self.precision = precision or Precision.uniform(loaded.model.dtype)
        self.gpt2 = gpt2 or GPT2(loaded.model, self.precision)
        self.cache = self.gpt2.new_cache(capacity)
        info = ModelInfo(
            loaded.name,
            loaded.is_random_weights,
            context_window=config.n_positions,
            vocab_size=config.vocab_size,
            max_token_chars=loaded.tokenizer.max_token_chars,
            max_token_bytes=loaded.tokenizer.max_token_bytes,
            compute=f"{self.precision.describe()}; {self.gpt2.describe_kernels()}",
            kv_cache_bytes=self.cache.kv.numel() * self.cache.kv.element_size(),
        )
        tokenizer = loaded.tokenizer
        grammars = Grammars(
            lambda: hf_grammar_tokenizer(tokenizer.backend, tokenizer.eos_token_id, info.vocab_size)
        )
        super().__init__(
            info,
            tokenizer,
            capacity,
            chat_template=chat_template,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefix_cache=prefix_cache,
            grammars=grammars,
            block_tokens=block_tokens,
        )
        self.model = loaded.model
        self.scored_token_cost = _scored_token_cost(config)
        self.device = self.gpt2.device
        graphs = None
        if cuda_graphs and self.device.type == "cuda":
            buckets = Buckets.doubling(capacity, info.context_window, SHORTEST_GRAPH_LENGTH)
            graphs = buckets, cuda_graph_capture(self.device)
        self.decode_step = DecodeStep(self.gpt2, self.cache, capacity, graphs)
        self.sampler = Sampler(self.device)
        self._seeds: list[int | None] = [None] * capacity  # by slot; None: greedy
        # By slot, for the prefix cache: the logits after the whole prompt whose
        # rows it holds, so that the same prompt again needs no prefill at all.
        self._kept_logits: torch.Tensor | None = None  # (slots, V)
        logger.info(
            "engine ready: %s%s; %s; %s; prefix cache %s",
            loaded.name,
            " (random weights)" if loaded.is_random_weights else "",
            info.compute,
            self.cache.describe(),
            f"on, blocks of {self.block_tokens}" if self.prefix_cache else "off",
        )

    def num_matmul_shapes(self) -> int:
        return num_matmul_shapes()

    def _start_prefill(self, newcomers: list[Sequence]) -> None:
        for seq in newcomers:
            self._seeds[seq.slot] = self.sampler.seed_for(seq.request)

    @torch.inference_mode()
    def _prefill_chunks(self, chunks: list[Chunk]) -> list[int]:
        # Only prompts are prefilled. Output that a resumed sequence already
        # streamed was decoded, a token a step, when it was drawn: it goes back in
        # the same way (`GPT2.replay`), so that what it draws next is bit for bit
        # what the uninterrupted run drew.
        prompts = [
            Chunk(seq, start, min(end, len(seq.prompt_token_ids))) for seq, start, end in chunks
        ]
        in_prompt = [i for i, (_, start, end) in enumerate(prompts) if start < end]
        last: dict[int, torch.Tensor] = {}  # (V,) logits after chunk i
        if in_prompt:
            after = self._prefill_prompts([prompts[i] for i in in_prompt])  # (B, V)
            last.update(zip(in_prompt, after, strict=True))
            if self.prefix_cache is not None:
                self._keep_prompt_logits([(prompts[i], last[i]) for i in in_prompt])
        for i, (seq, start, end) in enumerate(chunks):
            first = max(start, len(seq.prompt_token_ids))
            if first < end:
                replayed = self._tensor(seq.context_token_ids[first:end])
                last[i] = self.gpt2.replay(replayed, first, seq.slot, self.cache)
        return self._first_tokens(chunks, last)

    @torch.inference_mode()
    def _prefill_beside_decode(
        self, chunks: list[Chunk], decoding: list[Sequence]
    ) -> tuple[list[int], list[int]] | None:
        # On the CPU only, where a row's products are the same whatever rows share
        # the call (`Projection`), and only where decode steps are not captured
        # graphs; apart where a resumed sequence's output goes back in through
        # decode's own forward (`GPT2.replay`).
        is_eager_cpu = self.device.type == "cpu" and self.decode_step.buckets is None
        if not is_eager_cpu or any(end > len(seq.prompt_token_ids) for seq, _, end in chunks):
            return None
        token_ids, positions = self._decode_inputs(decoding)
        beside = DecodeRows(
            self._tensor(token_ids),
            self._tensor(positions),
            max(positions) + 1,
            [seq.slot for seq in decoding],
        )
        logits = self._prefill_prompts(chunks, beside)  # (B + W, V)
        after = dict(enumerate(logits[: len(chunks)]))
        if self.prefix_cache is not None:
            self._keep_prompt_logits([(chunk, after[i]) for i, chunk in enumerate(chunks)])
        first_tokens = self._first_tokens(chunks, after)
        seeds = [self._seeds[seq.slot] for seq in decoding]
        return first_tokens, self._choose(logits[len(chunks) :], decoding, seeds)

    def _first_tokens(self, chunks: list[Chunk], last: dict[int, torch.Tensor]) -> list[int]:
        """The next token of each sequence whose chunk ends its context, from
        ``last[i]``, the (V,) logits after chunk i."""
        ending = [i for i, (seq, _, end) in enumerate(chunks) if end == len(seq.context_token_ids)]
        if not ending:
            return []
        finishing = [chunks[i].seq for i in ending]
        logits = torch.stack([last[i] for i in ending])
        return self._choose(logits, finishing, [self._seeds[seq.slot] for seq in finishing])

    def _keep_prompt_logits(self, chunks: list[tuple[Chunk, torch.Tensor]]) -> None:
        """Keep the logits after each prompt these chunks complete (see `SlotEngine`)."""
        for (seq, _, end), logits in chunks:
            if end == len(seq.prompt_token_ids) and not seq.scores_prompt:
                if self._kept_logits is None:
                    self._kept_logits = logits.new_empty(self.capacity, logits.shape[-1])
                self._kept_logits[seq.slot] = logits

    @torch.inference_mode()
    def _copy_rows(self, source: Match, slot: int, start: int) -> None:
        rows = slice(start, source.num_tokens)
        self.cache.kv[:, :, slot, :, rows] = self.cache.kv[:, :, source.slot, :, rows]
        if source.is_whole and self._kept_logits is not None:
            self._kept_logits[slot] = self._kept_logits[source.slot]

    @torch.inference_mode()
    def _first_token_from_kept_logits(self, seq: Sequence) -> int:
        assert self._kept_logits is not None, "a whole prompt is held only after its logits"
        logits = self._kept_logits[seq.slot : seq.slot + 1].clone()  # (1, V); _choose biases it
        return self._choose(logits, [seq], [self._seeds[seq.slot]])[0]

    def _prefill_prompts(
        self, chunks: list[Chunk], beside: DecodeRows | None = None
    ) -> torch.Tensor:
        """Prefill prompt positions [start, end) of each sequence (scoring the prompts
        asked for), and decode ``beside`` in the same pass; returns the (B, V)
        logits after each chunk, then the decode's wanted rows'."""
        contexts = [seq.prompt_token_ids[start:end] for seq, start, end in chunks]
        scored = [i for i, (seq, _, _) in enumerate(chunks) if seq.wants_prompt_logprobs]
        logits, hidden = self.gpt2.prefill(
            self._tensor([token for context in contexts for token in context]),
            [len(context) for context in contexts],
            [seq.slot for seq, _, _ in chunks],
            self.cache,
            keep_all=scored,
            starts=[start for _, start, _ in chunks],
            block=self.block_tokens,
            beside=beside,
        )  # (B [+ W], V)
        for i, chunk_hidden in zip(scored, hidden, strict=True):
            self._score_chunk(*chunks[i], chunk_hidden)
        return logits

    def _score_chunk(self, seq: Sequence, start: int, end: int, hidden: torch.Tensor) -> None:
        """Score the prompt tokens that positions [start, end) predict, from their
        final hidden states (L, C): tokens start + 1 up to end, within the prompt
        (the token after its last position is the output's first); the first
        token has no score. The LM head runs over a few positions at a time, to
        bound the (n, V) logits."""
        num_top = seq.request.prompt_logprobs or 0
        targets = self._tensor(seq.prompt_targets(start, end))
        scores: list[TokenLogprob] = []
        for first in range(0, len(targets), _PROMPT_SCORE_CHUNK):
            last = min(first + _PROMPT_SCORE_CHUNK, len(targets))
            logprobs = self.gpt2.logits(hidden[first:last]).float().log_softmax(dim=-1)
            scores += _scores(logprobs, targets[first:last], num_top)
        seq.score_prompt_chunk(start, end, scores)

    @torch.inference_mode()
    def _decode(self, active: list[Sequence]) -> list[int]:
        token_ids, positions = self._decode_inputs(active)
        logits = self.decode_step.run(token_ids, positions, [seq.slot for seq in active])
        return self._choose(logits, active, [self._seeds[seq.slot] for seq in active])

    def _decode_inputs(self, active: list[Sequence]) -> tuple[list[int], list[int]]:
        """The token id and position of each row of a decode step of ``active``:
        slots 0..R-1. A slot that is not decoding (free, or still prefilling)
        below the highest live one, or padding a bucket, decodes a dummy token
        where that writes nothing read."""
        num_rows = self.decode_step.rows_for(max(seq.slot for seq in active) + 1)
        token_ids = [0] * num_rows
        positions = [self._scratch_position(slot) for slot in range(num_rows)]
        for seq in active:
            token_ids[seq.slot] = seq.last_token_id
            positions[seq.slot] = seq.num_tokens - 1
        return token_ids, positions

    def _choose(
        self, logits: torch.Tensor, seqs: list[Sequence], seeds: list[int | None]
    ) -> list[int]:
        """Each row's next token, after logit_bias, penalties, min_tokens (vLLM's
        order) and, for the rows with a grammar, the tokens it allows, recording
        its logprobs where the request asks for them."""
        scored = [
            i
            for i, seq in enumerate(seqs)
            if seq.request.logprobs is not None and seq.finish_reason is None
        ]
        # Logprobs are of the raw logits, before logit_bias and the penalties, as
        # vLLM reports them by default: its sampler computes them (logprobs_mode
        # raw_logprobs) before its logit-bias processor runs.
        raw = logits[self._tensor(scored)].float().log_softmax(dim=-1) if scored else None
        apply_logit_bias(logits, [seq.request for seq in seqs])
        apply_penalties(logits, seqs)
        masks = self.grammars.masks(seqs) if self.grammars is not None else None
        suppress_early_stops(logits, seqs, masks.rows_that_must_end(seqs) if masks else ())
        if masks is not None:
            apply_token_masks(logits, masks)
        next_ids = self.sampler.sample(
            logits,
            [seq.request for seq in seqs],
            seeds,
            [len(seq.output_token_ids) for seq in seqs],
        )
        if raw is not None:
            chosen = self._tensor([next_ids[i] for i in scored])
            num_top = max(seqs[i].request.logprobs or 0 for i in scored)
            scores = _scores(raw, chosen, num_top)
            for i, score in zip(scored, scores, strict=True):
                seqs[i].record_logprob(score)
        return next_ids

    def _release(self, slot: int) -> None:
        self._seeds[slot] = None

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, self.device, torch.long)


def _scored_token_cost(config: GPT2Config) -> float:
    """A scored prompt token's multiply-adds against a prefilled one's: the LM head
    at its position (V x C) besides every layer's projections (4 C^2 for
    attention, 2 C x inner for the MLP). About 1.9 for distilgpt2."""
    width, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    layer = 4 * width * width + 2 * width * inner
    return 1.0 + config.vocab_size * width / (config.n_layer * layer)


def _scores(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """Row i's logprob of ``chosen[i]`` and its ``num_top`` likeliest tokens, from
    (N, V) log-probabilities; two transfers to Python for the whole batch."""
    own = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    if num_top == 0:
        return [TokenLogprob(lp, [], []) for lp in own]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return [
        TokenLogprob(lp, ids, lps)
        for lp, ids, lps in zip(own, top_ids.tolist(), top_logprobs.tolist(), strict=True)
    ]
