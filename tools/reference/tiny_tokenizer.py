"""The tiny byte-level BPE tokenizer shared by every tiny fixture model.

It copies the shape of SmolLM2's tokenizer (the default model kvant serves), so
the tiny fixtures exercise the same code path as the real model:
  * specials first: 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>`;
  * pre-tokenizer: individual digits, then GPT-2 byte-level regex split
    (llama.cpp calls this pre-tokenizer `smollm`);
  * no BOS added when encoding; EOS is `<|im_end|>`; ChatML chat template.
The vocabulary is 320 entries: 3 specials + 256 byte symbols + 61 merges, learned
from the committed prose in tests/fixtures/text/ppl.txt (any fixed text would do;
that one is already in the repository).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 320
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID = 1
EOS_ID = 2
UNK_ID = 0
PAD_ID = 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# llama.cpp's GGUF token types (llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3


def train(corpus: str) -> Tokenizer:
    """Train the tokenizer on `corpus`; deterministic for a fixed corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise AssertionError(f"trained vocab has {tok.get_vocab_size()} entries, want {VOCAB_SIZE}")
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise AssertionError(f"special {s} is not id {i}")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json in the classic (pre-transformers-5) layout real checkpoints ship."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": 256,
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[UNK_ID],
    }


def save(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")


def gguf_vocab(tok: Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as convert_hf_to_gguf's gpt2 path writes them.

    Tokens keep their byte-level spelling (`Ġthe`), merges are "left right" strings.
    """
    model = json.loads(tok.to_str())["model"]
    by_id = {i: t for t, i in model["vocab"].items()}
    tokens = [by_id[i] for i in range(VOCAB_SIZE)]
    types = [TOKEN_TYPE_CONTROL if t in SPECIAL_TOKENS else TOKEN_TYPE_NORMAL for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, types, merges
