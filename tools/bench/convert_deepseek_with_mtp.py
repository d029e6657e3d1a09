#!/usr/bin/env python3
"""Convert a DeepSeek-V3 checkpoint to GGUF *with* its MTP layer.

llama.cpp's converter drops DeepSeek-V2/V3's multi-token-prediction layer
(`skip_mtp` on its deepseek2 model class); its DeepSeek-V3.2 class keeps it,
in llama.cpp's NextN layout: `block_count` counts it, `{arch}.nextn_predict_layers`
says how many of the last blocks are MTP layers, and the layer's own tensors
are `blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_head,shared_head_norm,
embed_tokens}` next to an ordinary block's. This wrapper applies the V3.2
class's handling to the deepseek2 class and changes nothing else, so that
kvant's self-speculative decoding can be measured on a quantized file.

    PYTHONPATH=$LCPP/gguf-py python tools/bench/convert_deepseek_with_mtp.py \\
        --converter $LCPP/convert_hf_to_gguf.py MODEL_DIR --outtype bf16 --outfile OUT.gguf

`--pre-tokenizer smollm` also makes the converter's pre-tokenizer check
answer that name, for the tiny test fixtures' tokenizer (as
tools/reference/convert_with_llama_cpp.py does).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--pre-tokenizer", help="answer the converter's pre-tokenizer check with this name")
    args, rest = ap.parse_known_args()
    converter = args.converter.resolve()
    sys.path.insert(0, str(converter.parent))
    sys.argv = [str(converter), *rest]
    module = importlib.import_module(converter.stem)
    import gguf
    from conversion.base import TextModel
    from conversion.deepseek import DeepseekV2Model

    if args.pre_tokenizer:
        TextModel.get_vocab_base_pre = lambda self, tokenizer: args.pre_tokenizer

    DeepseekV2Model.skip_mtp = False
    init, params = DeepseekV2Model.__init__, DeepseekV2Model.set_gguf_parameters

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        self.block_count = self.hparams["num_hidden_layers"] + self.hparams.get("num_nextn_predict_layers", 0)
        self.tensor_map = gguf.get_tensor_name_map(self.model_arch, self.block_count)

    def set_gguf_parameters(self):
        params(self)
        if n := self.hparams.get("num_nextn_predict_layers"):
            self.gguf_writer.add_block_count(self.block_count)
            self.gguf_writer.add_nextn_predict_layers(n)

    DeepseekV2Model.__init__ = __init__
    DeepseekV2Model.set_gguf_parameters = set_gguf_parameters
    module.main()


if __name__ == "__main__":
    main()
