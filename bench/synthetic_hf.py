"""The synthetic model saved as a Hugging Face directory (safetensors weights,
config, tokenizer), for tools that read one, such as llama.cpp's
convert_hf_to_gguf.py.

    python -m bench.synthetic_hf ~/.cache/minibatch-llm/llama.cpp/synthetic

The weights are the seeded ones that MODEL_ID=synthetic serves and the tokenizer
is the same GPT-2 BPE, so a converted copy answers a greedy request with the
same tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from worker.model.loader import gpt2_tokenizer, synthetic_model


def save(directory: Path) -> None:
    loaded = synthetic_model()
    config = loaded.model.config
    # llama.cpp's GPT-2 converter reads the context length as n_ctx, as distilgpt2's
    # own config.json spells it beside n_positions.
    config.n_ctx = config.n_positions
    loaded.model.save_pretrained(directory)
    eos_token_id = loaded.tokenizer.eos_token_id
    assert eos_token_id is not None, "GPT-2 has an end-of-text token"
    eos = loaded.tokenizer.decode([eos_token_id])  # GPT-2 uses it as BOS and UNK too
    # A copy: transformers adds the special token to the tokenizer it wraps, and the
    # loader's is shared.
    backend = Tokenizer.from_str(gpt2_tokenizer().to_str())
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, bos_token=eos, eos_token=eos, unk_token=eos
    )
    tokenizer.save_pretrained(directory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="created if missing")
    args = parser.parse_args(argv)
    save(args.directory)
    print(f"saved the synthetic model to {args.directory}")


if __name__ == "__main__":
    main()
