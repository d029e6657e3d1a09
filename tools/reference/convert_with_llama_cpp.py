#!/usr/bin/env python3
"""Run llama.cpp's own convert_hf_to_gguf.py on a tiny fixture checkpoint.

The converter identifies a BPE pre-tokenizer by hashing how the tokenizer splits
a fixed probe text and refuses hashes it does not know. The tiny fixture
tokenizer is new to it, but it splits text exactly like SmolLM2's (digits one by
one, then the GPT-2 regex), which llama.cpp calls `smollm`; so this wrapper makes
the converter's `get_vocab_base_pre` answer "smollm". DeepSeek-V3.2's converter
also insists that the tokenizer adds a BOS token, which the tiny tokenizer does
not; for that architecture the wrapper skips that assertion and writes the
vocabulary the way the converter then does (`_set_vocab_gpt2`). Nothing else
changes.

    python tools/reference/convert_with_llama_cpp.py --converter PATH/convert_hf_to_gguf.py \\
        MODEL_DIR --outtype f32 --outfile OUT.gguf

Every argument after --converter is passed to the converter unchanged. The
converter puts its own gguf-py (next to it) first on sys.path, so the writer is
the one that version of llama.cpp ships. See tools/reference/README.md for the
llama.cpp version the committed fixtures were made with.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

PRE_TOKENIZER = "smollm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    args, rest = ap.parse_known_args()
    converter = args.converter.resolve()
    if not converter.is_file():
        sys.exit(f"no converter at {converter}")
    sys.path.insert(0, str(converter.parent))
    sys.argv = [str(converter), *rest]
    module = importlib.import_module(converter.stem)
    from conversion.base import TextModel

    def known_pre_tokenizer(self, tokenizer) -> str:
        return PRE_TOKENIZER

    TextModel.get_vocab_base_pre = known_pre_tokenizer
    from conversion.deepseek import DeepseekV32Model

    DeepseekV32Model.set_vocab = TextModel._set_vocab_gpt2
    module.main()


if __name__ == "__main__":
    main()
