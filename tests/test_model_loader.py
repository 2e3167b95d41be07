"""Model sources: synthetic, local directory, hub id, and the offline fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from protocol.settings import ConfigError  # noqa: E402
from tests.model_fixtures import tiny_model  # noqa: E402
from worker.engine.torch_engine import load_engine  # noqa: E402
from worker.model.loader import (  # noqa: E402
    SYNTHETIC,
    ModelLoadError,
    gpt2_tokenizer,
    load_model,
)
from worker.serve.config import WorkerConfig  # noqa: E402

pytestmark = pytest.mark.model

CPU = torch.device("cpu")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_synthetic_tokenizer_is_the_real_gpt2_bpe() -> None:
    backend = gpt2_tokenizer()
    assert backend.encode("The capital of France is").ids == [464, 3139, 286, 4881, 318]
    text = "naïve café — 東京"
    assert backend.decode(backend.encode(text).ids) == text


def test_default_model_id_falls_back_to_synthetic_with_a_warning(
    offline: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.model.loader"):
        config = WorkerConfig()
        loaded = load_model(config.model_to_load, CPU, torch.float32, may_fall_back=True)
    assert loaded.name == SYNTHETIC and loaded.is_random_weights
    assert "RANDOM WEIGHTS" in caplog.text and "distilgpt2" in caplog.text
    assert loaded.model.config.n_layer == 6 and loaded.model.config.vocab_size == 50257


def test_explicit_model_id_that_cannot_load_stops_with_a_clear_error(offline: None) -> None:
    with pytest.raises(ModelLoadError, match=r"MODEL_ID='no-such-org/no-such-model'.*'synthetic'"):
        load_model("no-such-org/no-such-model", CPU, torch.float32)


def test_an_explicit_distilgpt2_does_not_fall_back(offline: None) -> None:
    with pytest.raises(ModelLoadError, match=r"MODEL_ID='distilgpt2' cannot be loaded"):
        load_engine(WorkerConfig(model_id="distilgpt2", device="cpu"))


def test_local_directory_loads(tmp_path: Path) -> None:
    source = tiny_model()
    source.model.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()).save_pretrained(tmp_path)
    engine = load_engine(WorkerConfig(model_id=str(tmp_path), device="cpu"))
    assert engine.info.name == str(tmp_path) and not engine.info.is_random_weights
    assert engine.info.context_window == source.model.config.n_positions
    assert engine.tokenizer.encode("The capital") == [464, 3139]
    for name, weight in source.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], weight), name


def test_synthetic_engine_info_and_dtype() -> None:
    engine = load_engine(WorkerConfig(model_id="synthetic", device="cpu", dtype="bfloat16"))
    assert engine.info.name == SYNTHETIC and engine.info.is_random_weights
    assert engine.info.context_window == 1024
    assert engine.cache.kv.dtype == torch.bfloat16
    assert engine.cache.kv.shape == (6, 2, 8, 12, 1024, 64)


def test_a_kv_cache_larger_than_memory_is_refused_naming_max_batch_size(tmp_path: Path) -> None:
    source = tiny_model()
    source.model.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()).save_pretrained(tmp_path)
    config = WorkerConfig(model_id=str(tmp_path), device="cpu", max_batch_size=2**31 - 1)
    with pytest.raises(
        ConfigError, match=r"MAX_BATCH_SIZE=2147483647 needs a KV cache of [\d,.]+ GiB"
    ):
        load_engine(config)
