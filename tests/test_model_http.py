"""The torch engine behind real worker and frontend processes, on a small model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

from tests.metrics_scrape import scrape, total, value
from tests.sse import sse_events
from tests.stack import running_stack
from worker.model.loader import gpt2_tokenizer, synthetic_config, synthetic_model

pytestmark = pytest.mark.model

CONTEXT_WINDOW = 64


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GPT-2 with the real tokenizer and a 64-token context, saved to disk."""
    directory = tmp_path_factory.mktemp("small-gpt2")
    config = synthetic_config(n_layer=2, n_embd=64, n_head=4, n_positions=CONTEXT_WINDOW)
    synthetic_model(config).model.save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()).save_pretrained(directory)
    return directory


def test_context_overflow_is_422_with_both_numbers_and_the_limit(
    tmp_path: Path, small_model_dir: Path
) -> None:
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        health = stack.wait_live(timeout_s=120)
        assert health["context_window"] == CONTEXT_WINDOW
        assert health["random_weights"] is False  # loaded from a directory, as a user's would be
        prompt = "The capital of France is"  # 5 tokens
        fits = httpx.post(
            f"{stack.url}/generate",
            json={"prompt": prompt, "max_new_tokens": 59, "ignore_eos": True},
            timeout=60,
        )
        assert fits.status_code == 200, fits.text
        assert fits.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 59}
        too_long = httpx.post(
            f"{stack.url}/generate", json={"prompt": prompt, "max_new_tokens": 60}, timeout=60
        )
        assert too_long.status_code == 422
        message = too_long.json()["error"]["message"]
        assert message.startswith(
            "prompt: 5 tokens and 60 to generate, more than the context window of 64 "
        )
        # The torch worker's memory in /metrics, and in /health how it computes.
        samples = scrape(stack.url)
        kv_cache_bytes = total(samples, "minibatch_worker_kv_cache_bytes")
        # 2 layers x {K, V} x 8 slots x 4 heads x 64 positions x 16 head_dim, float32
        assert kv_cache_bytes == 2 * 2 * 8 * 4 * 64 * 16 * 4
        assert total(samples, "minibatch_worker_rss_bytes") > kv_cache_bytes
        compute = stack.health().json()["workers"][0]["compute"]
        assert "kernels" in compute
        cores = len(os.sched_getaffinity(0))  # a lone worker's TORCH_THREADS default
        assert compute.endswith(f", {cores} thread{'s' if cores > 1 else ''}"), compute
        # oneDNN's shapes from the prefill just run; none where every product is
        # on the kernel (float32 too, on an AVX-512 build).
        shapes = total(samples, "minibatch_worker_matmul_shapes")
        assert shapes > 0 if "on onednn" in compute else shapes == 0, compute


def test_echoed_logprobs_over_http_match_hf_on_the_same_weights(
    tmp_path: Path, small_model_dir: Path
) -> None:
    """What lm-eval's local-completions model asks for, held to the HF model loaded
    from the same directory; and the chat endpoint on a model without a template."""
    model = GPT2LMHeadModel.from_pretrained(small_model_dir)
    prompt_ids = gpt2_tokenizer().encode("The quick brown fox jumps over the lazy dog").ids
    with torch.inference_mode():
        reference = model(torch.tensor([prompt_ids])).logits[0].log_softmax(dim=-1)
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live(timeout_s=120)
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        model_name = client.models.list().data[0].id
        completion = client.completions.create(
            model=model_name,
            prompt=[prompt_ids],
            max_tokens=1,
            echo=True,
            logprobs=1,
            temperature=0,
        )
        chat = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs[0] is None
    served = torch.tensor(logprobs.token_logprobs[1 : len(prompt_ids)])
    expected = reference[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    assert (served - expected).abs().max().item() < 1e-4
    generated = logprobs.token_logprobs[-1]
    assert generated is not None and abs(generated - reference[-1].max().item()) < 1e-4
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.prompt_tokens == len(gpt2_tokenizer().encode("User: Hi\n\nAssistant:").ids)


def test_text_offsets_point_into_the_text_where_tokens_split_characters(
    tmp_path: Path, small_model_dir: Path
) -> None:
    """GPT-2 writes an emoji as three byte tokens; the offsets after it are where
    the text is, streamed or not."""
    prompt = "héllo wörld 🎉 ok"
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live(timeout_s=120)
        body = {"model": str(small_model_dir), "prompt": prompt, "max_tokens": 0, "echo": True}
        body["logprobs"] = 0
        answer = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30).json()
        streamed = httpx.post(
            f"{stack.url}/v1/completions", json={**body, "stream": True}, timeout=30
        )
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt
    # GPT-2 writes " 🎉" as three tokens, none a whole character: named by their bytes.
    assert "bytes:\\x20\\xf0\\x9f, bytes:\\x8e, bytes:\\x89" in ", ".join(logprobs["tokens"])
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        if not token.startswith("bytes:"):
            assert prompt[offset:].startswith(token), (token, offset)
    assert logprobs["text_offset"][-1] == prompt.index(" ok")
    streamed_offsets = [o for lp in _streamed_logprobs(streamed) for o in lp["text_offset"]]
    assert streamed_offsets == logprobs["text_offset"]


def _named(piece: list[int]) -> str:
    """How completions name a token that holds part of a character."""
    return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


def _streamed_logprobs(response: httpx.Response) -> list[dict[str, Any]]:
    """Each chunk's logprobs, in order, from a stream's every event (but [DONE])."""
    events = [data for _, data in sse_events(response)]
    assert events[-1] == "[DONE]", events[-1:]
    return [
        choice["logprobs"]
        for data in events[:-1]
        for choice in json.loads(data)["choices"]
        if choice["logprobs"]
    ]


def _char_offsets(text: str, token_bytes: list[bytes]) -> list[int]:
    """Where the character holding each token's first byte begins in ``text``."""
    encoded, offsets, start = text.encode(), [], 0
    for piece in token_bytes:
        offsets.append(len(encoded[:start].decode(errors="ignore")))
        start += len(piece)
    return offsets


def test_generated_characters_split_over_tokens_get_their_bytes_and_offsets(
    tmp_path: Path, small_model_dir: Path
) -> None:
    """Chat's bytes make the text again, and text_offset is each token's own
    character, the same streamed or not."""
    text = "日本語😀é ok"
    grammar = {"structured_outputs": {"regex": text}, "seed": 3, "max_tokens": 30}
    completion = {"model": str(small_model_dir), "prompt": "Say:", "logprobs": 1, **grammar}
    chat = {"model": str(small_model_dir), "messages": [{"role": "user", "content": "Say"}]}
    chat.update(logprobs=True, top_logprobs=2, **grammar)
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live(timeout_s=120)
        url = f"{stack.url}/v1"
        answer = httpx.post(f"{url}/completions", json=completion, timeout=30).json()
        streamed = httpx.post(f"{url}/completions", json={**completion, "stream": True})
        chatted = httpx.post(f"{url}/chat/completions", json=chat, timeout=30).json()
    (choice,) = answer["choices"]
    assert choice["text"] == text
    (message,) = chatted["choices"]
    assert message["message"]["content"] == text
    content = message["logprobs"]["content"]
    pieces = [bytes(token["bytes"]) for token in content]
    assert b"".join(pieces) == text.encode()
    assert any(token["token"] == "\N{REPLACEMENT CHARACTER}" for token in content)
    assert all(len(token["top_logprobs"]) == 2 for token in content)
    assert [
        token["token"] if token["token"] != "\N{REPLACEMENT CHARACTER}" else _named(token["bytes"])
        for token in content
    ] == choice["logprobs"]["tokens"]
    assert choice["logprobs"]["text_offset"] == _char_offsets(text, pieces)
    streamed_offsets = [o for lp in _streamed_logprobs(streamed) for o in lp["text_offset"]]
    assert streamed_offsets == choice["logprobs"]["text_offset"]


def test_eos_generated_past_counts_but_is_no_text(tmp_path: Path, small_model_dir: Path) -> None:
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live(timeout_s=120)
        body = {"model": str(small_model_dir), "prompt": "Hi", "max_tokens": 4, "temperature": 0}
        body.update(ignore_eos=True, logit_bias={"50256": 100}, logprobs=0)  # EOS, every time
        answer = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30).json()
        chat = {"model": str(small_model_dir), "messages": [{"role": "user", "content": "Hi"}]}
        chat.update(body, logprobs=True)
        del chat["prompt"]
        chatted = httpx.post(f"{stack.url}/v1/chat/completions", json=chat, timeout=30).json()
    assert answer["choices"][0]["text"] == ""
    assert answer["usage"]["completion_tokens"] == 4
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<|endoftext|>"] * 4
    assert logprobs["text_offset"] == [0, 0, 0, 0]  # the text has none of them
    content = chatted["choices"][0]["logprobs"]["content"]
    assert [token["bytes"] for token in content] == [[]] * 4


def test_min_p_reaches_the_sampler_from_every_endpoint(
    tmp_path: Path, small_model_dir: Path
) -> None:
    """min_p 1 keeps only the likeliest token: a hot sampled request then writes
    the greedy text, on the native and the OpenAI endpoints alike."""
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu"}
    with running_stack(tmp_path, overrides, supervised=False) as stack:
        stack.wait_live(timeout_s=120)

        def text(path: str, **fields: object) -> str:
            body = {"prompt": "The river", "ignore_eos": True, **fields}
            answer = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            answer_json = answer.json()
            return str(
                answer_json["text"] if path == "/generate" else answer_json["choices"][0]["text"]
            )

        greedy = text("/generate", max_new_tokens=12)
        hot = {"temperature": 2.0, "seed": 11}
        assert text("/generate", max_new_tokens=12, **hot) != greedy  # it does sample
        assert text("/generate", max_new_tokens=12, min_p=1.0, **hot) == greedy
        openai_body = {"model": str(small_model_dir), "max_tokens": 12, **hot}
        assert text("/v1/completions", min_p=1.0, **openai_body) == greedy


def test_the_prefix_cache_over_http_counts_what_it_served(
    tmp_path: Path, small_model_dir: Path
) -> None:
    """Each answer's usage says how many prompt tokens came from the prefix cache,
    /metrics counts them, and the answers are the ones computed in full. A prompt
    sent before, with a cache_salt of its own, finds nothing."""
    system = [(7 * i) % 500 + 10 for i in range(20)]  # 20 tokens: two blocks of 8
    overrides = {"MODEL_ID": str(small_model_dir), "DEVICE": "cpu", "PREFILL_CHUNK_TOKENS": "8"}
    answers = {}
    for prefix_cache in ("0", "1"):
        with running_stack(
            tmp_path / prefix_cache, {**overrides, "PREFIX_CACHE": prefix_cache}, supervised=False
        ) as stack:
            stack.wait_live(timeout_s=120)
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
            model_name = client.models.list().data[0].id
            prompts = ([*system, 1, 2, 3], [*system, 4, 5], [*system, 1, 2, 3])
            salts = ({}, {}, {}, {"cache_salt": "tenant b"})
            completions = [
                client.completions.create(
                    model=model_name, prompt=[prompt], max_tokens=4, temperature=0, extra_body=salt
                )
                for prompt, salt in zip([*prompts, prompts[0]], salts, strict=True)
            ]
            samples = scrape(stack.url)
        answers[prefix_cache] = [c.choices[0].text for c in completions]
        cached = []
        for completion in completions:
            assert completion.usage is not None and completion.usage.prompt_tokens_details
            cached.append(completion.usage.prompt_tokens_details.cached_tokens)
        expected = [0, 0, 0, 0] if prefix_cache == "0" else [0, 16, 23, 0]  # blocks; all
        assert cached == expected
        looked_up = 0 if prefix_cache == "0" else 23 + 22 + 23 + 23
        assert value(samples, "minibatch_prefix_cache_queries_total") == looked_up
        assert value(samples, "minibatch_prefix_cache_hits_total") == sum(expected)
    assert answers["1"] == answers["0"]
