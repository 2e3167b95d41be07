"""Model sources: synthetic, local directory, hub id, and the offline fallback."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from protocol.settings import ConfigError  # noqa: E402
from tests.model_fixtures import tiny_model  # noqa: E402
from worker.engine.memory_limit import memory_limit_bytes  # noqa: E402
from worker.model.loader import (  # noqa: E402
    SYNTHETIC,
    ModelLoadError,
    TextTokenizer,
    gpt2_tokenizer,
    load_model,
)
from worker.serve import load as engine_load  # noqa: E402
from worker.serve.config import WorkerConfig  # noqa: E402
from worker.serve.load import load_engine  # noqa: E402

pytestmark = pytest.mark.model

CPU = torch.device("cpu")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_every_gpt2_tokens_bytes_decode_to_its_text_and_make_the_text_together() -> None:
    tokenizer = TextTokenizer(gpt2_tokenizer(), 50256)
    ids = range(50257)
    texts = tokenizer.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert [piece.decode(errors="replace") for piece in pieces] == texts
    text = "naïve café — 東京 🎉 <|endoftext|>"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert tokenizer.token_bytes(50256) == b"<|endoftext|>"


def test_synthetic_tokenizer_is_the_real_gpt2_bpe() -> None:
    backend = gpt2_tokenizer()
    assert backend.encode("The capital of France is").ids == [464, 3139, 286, 4881, 318]
    text = "naïve café — 東京"
    assert backend.decode(backend.encode(text).ids) == text
    # The end token in a text (a chat template's eos_token, say) is the end token,
    # as in GPT-2's own tokenizer.json, not 7 tokens of its letters.
    assert TextTokenizer(backend, 50256).encode("a<|endoftext|>b") == [64, 50256, 65]


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


def test_a_local_path_that_is_not_a_directory_is_named_as_such(tmp_path: Path) -> None:
    missing, file = tmp_path / "no-such-dir", tmp_path / "config.json"
    file.write_text("{}")
    for path, problem in [
        (str(missing), f"{missing} is no directory here"),
        (str(file), f"{file} is a file, not a model directory"),
        ("~/model", "~/model: ~ is not expanded here; write the whole path"),
    ]:
        with pytest.raises(ModelLoadError, match=re.escape(problem)):
            load_model(path, CPU, torch.float32)


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


def _saved_tiny_model(directory: Path) -> str:
    source = tiny_model()
    source.model.save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()).save_pretrained(directory)
    return str(directory)


def test_a_kv_cache_larger_than_memory_is_refused_naming_max_batch_size(tmp_path: Path) -> None:
    config = WorkerConfig(
        model_id=_saved_tiny_model(tmp_path), device="cpu", max_batch_size=2**31 - 1
    )
    with pytest.raises(
        ConfigError,
        match=r"MAX_BATCH_SIZE=2147483647 needs a KV cache of [\d,.]+ GiB .* \(the host's memory\)"
        r": lower MAX_BATCH_SIZE$",
    ):
        load_engine(config)


def test_the_kv_caches_of_every_worker_must_fit_the_cgroups_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One cache fits, two do not: the OOM killer would end one of two workers."""
    model_id = _saved_tiny_model(tmp_path)
    one_cache = load_engine(WorkerConfig(model_id=model_id, device="cpu")).cache.nbytes
    held = 2**30  # the model and torch, resident already
    limit = (held * 3 // 2 + one_cache * 3 // 2, "its cgroup's memory.max")
    monkeypatch.setattr(engine_load, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(engine_load, "resident_bytes", lambda: held)

    assert load_engine(WorkerConfig(model_id=model_id, device="cpu", num_workers=1))
    with pytest.raises(ConfigError) as caught:
        load_engine(WorkerConfig(model_id=model_id, device="cpu", num_workers=2))
    assert "in each of NUM_WORKERS=2" in str(caught.value)
    assert (
        "which with the 1.00 GiB this worker holds already (the model, torch) and 0.50 GiB "
        "for its steps' working memory is" in str(caught.value)
    )
    assert str(caught.value).endswith(
        "this process may use (its cgroup's memory.max): lower MAX_BATCH_SIZE or NUM_WORKERS"
    )
    # What the worker holds counts: one cache no longer fits beside twice as much.
    monkeypatch.setattr(engine_load, "resident_bytes", lambda: 2 * held)
    with pytest.raises(ConfigError, match=r"lower MAX_BATCH_SIZE$"):
        load_engine(WorkerConfig(model_id=model_id, device="cpu", num_workers=1))


def _cgroup_file(root: Path, relative: str, name: str, value: str) -> None:
    (root / relative).mkdir(parents=True, exist_ok=True)
    (root / relative / name).write_text(value + "\n")


def test_the_memory_limit_is_the_smallest_of_the_host_and_every_cgroup_above(
    tmp_path: Path,
) -> None:
    root, proc_cgroup = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    host_memory, _ = memory_limit_bytes(tmp_path / "none", root)
    proc_cgroup.write_text("0::/system.slice/app.service\n")
    assert memory_limit_bytes(proc_cgroup, root) == (host_memory, "the host's memory")

    _cgroup_file(root, "system.slice/app.service", "memory.max", "max")
    _cgroup_file(root, "system.slice", "memory.max", str(2**30))
    assert memory_limit_bytes(proc_cgroup, root) == (2**30, "its cgroup's memory.max")
    _cgroup_file(root, "system.slice/app.service", "memory.max", str(2**29))
    assert memory_limit_bytes(proc_cgroup, root)[0] == 2**29


def test_a_v1_container_whose_cgroup_path_is_hidden_reads_its_limit_at_the_root(
    tmp_path: Path,
) -> None:
    root, proc_cgroup = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    proc_cgroup.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    _cgroup_file(root, "memory", "memory.limit_in_bytes", str(2**62))  # v1's "unlimited"
    assert memory_limit_bytes(proc_cgroup, root)[1] == "the host's memory"
    _cgroup_file(root, "memory", "memory.limit_in_bytes", str(3 * 2**30))
    assert memory_limit_bytes(proc_cgroup, root) == (
        3 * 2**30,
        "its cgroup's memory.limit_in_bytes",
    )
