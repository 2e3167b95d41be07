"""The synthetic model saved as a Hugging Face directory loads back as the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bench import synthetic_hf  # noqa: E402
from worker.model.loader import gpt2_tokenizer, load_model, synthetic_model  # noqa: E402

pytestmark = pytest.mark.model


def test_saved_directory_is_the_synthetic_model(tmp_path: Path) -> None:
    synthetic_hf.save(tmp_path)
    loaded = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    assert not loaded.is_random_weights  # served as a local directory, not as synthetic
    reference = synthetic_model().model.state_dict()
    for name, weight in loaded.model.state_dict().items():
        assert torch.equal(weight, reference[name]), name
    text = "The capital of France is<|endoftext|>"
    assert loaded.tokenizer.encode(text) == [464, 3139, 286, 4881, 318, 50256]
    assert loaded.tokenizer.eos_token_id == 50256
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["n_ctx"] == config["n_positions"] == 1024  # what llama.cpp's converter reads
    # As the loader's own: GPT-2's end token is special in both.
    assert gpt2_tokenizer().encode(text).ids == [464, 3139, 286, 4881, 318, 50256]
