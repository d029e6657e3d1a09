#!/usr/bin/env python3
"""Reference fixtures for kvant's tokenizers and chat templates.

Writes, deterministically:

tests/fixtures/tokenizer/
  smollm2-tokenizer.gguf      the same keys (plus tokenizer.chat_template) in a GGUF without tensors
  smollm2.json                {text, ids, decoded, decoded_skip_special} for a multilingual test set
  smollm2-hf/                 tokenizer.json + tokenizer_config.json saved by transformers
  spm-tokenizer.gguf, spm.json, spm-hf/
                              the same for a small SentencePiece BPE model ("llama" tokenizer) trained here
tests/fixtures/chat/strftime.json
                              C strftime output for fixed UTC times
tests/fixtures/chat/*.json    chat templates rendered by transformers' apply_chat_template
                               (hermes_tools.json: with tools and tool turns)

SmolLM2 reference ids. llama.cpp tokenizes pre="smollm" by splitting every digit (\\p{N}) out first and then
applying the GPT-2 regex; the upstream SmolLM2 tokenizer.json does the same (Digits(individual_digits) then
ByteLevel). transformers' GGUF loader does not know "smollm" and uses the plain GPT-2 ByteLevel regex, which
differs where a whitespace run meets a digit: "x  1" is [x, "  ", 1] upstream and [x, " ", " 1"] there. The
reference below is the upstream pipeline (transformers' GGUF tokenizer with its pre-tokenizer replaced); cases
where transformers' GGUF tokenizer disagrees carry its ids under "transformers_gguf_ids" as a record of that
discrepancy.

SentencePiece reference ids come from sentencepiece itself. For text containing special tokens they follow
llama.cpp: the text is cut at every control / user-defined / unknown token, and each plain fragment is encoded
on its own (so each gets the dummy-prefix space), which is what llama.cpp's SPM tokenizer does. Decoded text
comes from transformers' tokenizer built from the fixture GGUF (Replace, ByteFallback, Fuse, Strip).
transformers tokenizes that GGUF differently (Metaspace, prepend_scheme "first"): no "\u2581" prefix after a
special token, and none added when the text already starts with a space. Its ids are kept as "hf_ids" (with
"hf_decoded") to test the tokenizer.json path, which must reproduce transformers.

Usage: make_tokenizer_fixtures.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]   (default: $KVANT_MODEL)
"""

import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
TOK_DIR = ROOT / "tests" / "fixtures" / "tokenizer"
CHAT_DIR = ROOT / "tests" / "fixtures" / "chat"

# GGUF token types (llama.cpp's llama_token_type, identical to SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

TEXTS = [
    "",
    "Hello world",
    "Hello world! 123",
    "  multiple   spaces",
    " leading space",
    "trailing spaces   ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it, isn't it? He'd said we'D.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "你好，世界！今天天气很好。",
    "こんにちは世界、カタカナとひらがな。",
    "안녕하세요 세계",
    "Ελληνικά και עברית و العربية",
    "I \u2764\ufe0f \U0001f980 and \U0001f355!",
    "Family: \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466, flags: \U0001f1fa\U0001f1e6\U0001f1ef\U0001f1f5, "
    "wave: \U0001f44b\U0001f3fd, pride: \U0001f3f3\ufe0f\u200d\U0001f308",
    "a\tb\t\tc",
    "line1\nline2\n\nline3\r\nline4",
    "   \n\t  \n",
    "\n",
    "x  1",
    "x \t 22",
    "3.14159 2718281828 1000000 -42 +7 1e-9",
    "In 2024, 1,234,567 people paid $99.99 each.",
    "\u0663\u0664\u0665 \u00bd \u216b 12\u00b3",
    "fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{:?}\", x);\n}\n",
    "def f(a, b):\n\treturn a**2 + b // 3  # comment\n\n\nclass A:\n        pass",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "<|im_start|><|im_end|>",
    "not special: <|im_start <im_end|> < |im_end| >",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00e7\u00e0f\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u201cquotes\u201d \u2018single\u2019 \u2026 \u00a9\u00ae\u2122",
    "Tab\tafter\u00a0nbsp and\u2003em space",
    "ctrl \u0001\u0004\u001f\u007f zero\u200bwidth \ufeffbom",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "============ !!!???... ----->>>",
    "proto://host.test/a/b?q=1&r=2#frag user@host.test",
]

# Extra cases for the SentencePiece model: its own special tokens in text.
SPM_EXTRA_TEXTS = [
    "<s>Hello</s>",
    "first</s>second <s> third",
    "unknown <unk> here",
    "<|sep|>after a user-defined token",
]


def dump_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
        f.write("\n")


def dump_json_compact(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def tokenizer_fields(reader: gguf.GGUFReader) -> dict:
    """All tokenizer.* key/values of a GGUF as Python values plus their GGUF types."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[1] if value_type == gguf.GGUFValueType.ARRAY else None
            out[key] = (field.contents(), value_type, sub_type)
    return out


def spec_from_fields(fields: dict) -> dict:
    """kvant's GgufTokenizerSpec (serde field names) from tokenizer.ggml.* values."""

    def get(name):
        entry = fields.get("tokenizer.ggml." + name)
        return None if entry is None else entry[0]

    return {
        "model": get("model"),
        "pre": get("pre"),
        "tokens": get("tokens"),
        "scores": get("scores"),
        "token_types": get("token_type"),
        "merges": get("merges"),
        "bos_id": get("bos_token_id"),
        "eos_id": get("eos_token_id"),
        "eot_id": get("eot_token_id"),
        "eom_id": get("eom_token_id"),
        "unk_id": get("unknown_token_id"),
        "pad_id": get("padding_token_id"),
        "add_bos": get("add_bos_token"),
        "add_eos": get("add_eos_token"),
        "add_space_prefix": get("add_space_prefix"),
    }


def write_tokenizer_gguf(path: Path, arch: str, fields: dict) -> None:
    """A GGUF holding only tokenizer metadata: no tensors, so tests need not load a model."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, value_type, sub_type) in fields.items():
        writer.add_key_value(key, value, value_type, sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_hf_dir(tok, hf_dir: Path) -> None:
    """tokenizer.json (compact) and tokenizer_config.json as transformers saves them."""
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
    for volatile in ("is_local", "local_files_only"):
        config.pop(volatile, None)
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)
    tok.backend_tokenizer.save(str(hf_dir / "tokenizer.json"), pretty=False)
    dump_json(hf_dir / "tokenizer_config.json", config)


# ---------------------------------------------------------------- SmolLM2 (byte-level BPE, pre=smollm)


def make_smollm2(model_path: Path) -> dict:
    reader = gguf.GGUFReader(str(model_path))
    fields = tokenizer_fields(reader)
    spec = spec_from_fields(fields)
    assert spec["model"] == "gpt2" and spec["pre"] == "smollm", (spec["model"], spec["pre"])
    write_tokenizer_gguf(TOK_DIR / "smollm2-tokenizer.gguf", "llama", fields)

    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    gguf_backend = HfTokenizer.from_str(tok.backend_tokenizer.to_str())
    # The upstream SmolLM2 pipeline, which is what llama.cpp's "smollm" pre-tokenizer implements.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )

    cases = []
    discrepancies = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        case = {
            "text": text,
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        }
        gguf_ids = gguf_backend.encode(text, add_special_tokens=False).ids
        if gguf_ids != ids:
            case["transformers_gguf_ids"] = gguf_ids
            discrepancies += 1
        cases.append(case)
    print(f"smollm2: {len(cases)} cases, transformers' GGUF tokenizer differs on {discrepancies}")
    dump_json(TOK_DIR / "smollm2.json", {"bos_id": spec["bos_id"], "eos_id": spec["eos_id"], "cases": cases})

    save_hf_dir(tok, TOK_DIR / "smollm2-hf")
    return {"tokenizer": tok, "chat_template": fields["tokenizer.chat_template"][0]}


# ---------------------------------------------------------------- SentencePiece BPE ("llama" tokenizer)

WORDS = {
    "en": "the of and to in is that it for was on are as with his they at be this from have or by one had not "
    "but what all were when we there can an your which their said if do will each about how up out them then "
    "she many some so these would other into has more her two like him see time could no make than first been "
    "its who now people my made over did down only way find use may water long little very after words called",
    "ru": "и в не на я быть он с что а по это она этот к но они мы как из у который то за свой весь год от так "
    "о для ты же все тот мочь вы человек такой его сказать только или ещё бы себя один как уже до время если "
    "сам когда другой вот говорить наш мой знать стать при чтобы дело жизнь кто первый очень два день её новый",
    "de": "der die und in den von zu das mit sich des auf für ist im dem nicht ein eine als auch es an werden aus "
    "er hat daß sie nach wird bei einer um am sind noch wie einem über einen so zum war haben nur oder aber vor "
    "zur bis mehr durch man sein wurde sei Straße Größe Übung schön",
    "fr": "le de un être et à il avoir ne je son que se qui ce dans en du elle au pour pas que vous par sur faire "
    "plus dire me on mon lui nous comme mais pouvoir avec tout y aller voir en bien où sans tu ou leur homme "
    "déjà très été français garçon naïve",
    "zh": "的 一 是 不 了 人 我 在 有 他 这 中 大 来 上 国 个 到 说 们 为 子 和 你 地 出 道 也 时 年",
}


def spm_corpus() -> list:
    rng = random.Random(20240611)
    langs = sorted(WORDS)
    vocab = {lang: WORDS[lang].split() for lang in langs}
    lines = []
    for _ in range(1500):
        lang = rng.choice(langs)
        n = rng.randint(3, 14)
        words = [rng.choice(vocab[lang]) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 99999)))
        sep = "" if lang == "zh" else " "
        line = sep.join(words)
        if rng.random() < 0.2:
            line = line.replace(" ", "  ", 1)
        if rng.random() < 0.5:
            line = line[:1].upper() + line[1:] + rng.choice([".", "!", "?", ",", ";"])
        lines.append(line)
    return lines


def train_spm() -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(spm_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=1100,
        byte_fallback=True,
        character_coverage=0.995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["<|sep|>"],
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def make_spm() -> None:
    model_bytes = train_spm()
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)

    tokens = [p.piece for p in proto.pieces]
    scores = [p.score for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]
    specials = {t: i for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED, UNKNOWN)}

    T = gguf.GGUFValueType
    fields = {
        "tokenizer.ggml.model": ("llama", T.STRING, None),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
        "tokenizer.ggml.scores": (scores, T.ARRAY, T.FLOAT32),
        "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
        "tokenizer.ggml.bos_token_id": (sp.bos_id(), T.UINT32, None),
        "tokenizer.ggml.eos_token_id": (sp.eos_id(), T.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (sp.unk_id(), T.UINT32, None),
        "tokenizer.ggml.add_bos_token": (True, T.BOOL, None),
        "tokenizer.ggml.add_eos_token": (False, T.BOOL, None),
        "tokenizer.ggml.add_space_prefix": (True, T.BOOL, None),
    }
    write_tokenizer_gguf(TOK_DIR / "spm-tokenizer.gguf", "llama", fields)

    special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))

    def reference_ids(text):
        ids, pos = [], 0
        for m in special_re.finditer(text):
            if m.start() > pos:
                ids += sp.encode(text[pos : m.start()])
            ids.append(specials[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids += sp.encode(text[pos:])
        return ids

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(TOK_DIR / "spm-tokenizer.gguf", Path(tmp) / "spm.gguf")
        hf = AutoTokenizer.from_pretrained(tmp, gguf_file="spm.gguf")
    save_hf_dir(hf, TOK_DIR / "spm-hf")

    cases = []
    hf_differs = 0
    byte_fallback_cases = 0
    for text in TEXTS + SPM_EXTRA_TEXTS:
        ids = reference_ids(text)
        if not special_re.search(text):
            assert sp.decode(ids) == text, text
        if any(types[i] == BYTE for i in ids):
            byte_fallback_cases += 1
        if hf.encode(text, add_special_tokens=False) != ids:
            hf_differs += 1
        hf_ids = hf.encode(text, add_special_tokens=False)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "decoded": hf.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": hf.decode(ids, skip_special_tokens=True),
                # transformers' own tokenization (Metaspace, prefix only at the start) for the
                # tokenizer.json path, and its decoding.
                "hf_ids": hf_ids,
                "hf_decoded": hf.decode(hf_ids, skip_special_tokens=False),
            }
        )
    print(
        f"spm: vocab {len(tokens)}, {len(cases)} cases, {byte_fallback_cases} use byte fallback, "
        f"transformers' GGUF tokenizer differs on {hf_differs}"
    )
    dump_json(TOK_DIR / "spm.json", {"bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "cases": cases})


# ---------------------------------------------------------------- chat templates

LLAMA3_STYLE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Date length: " + strftime_now("%d %b %Y") | length | string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# No whitespace-control dashes: the output depends on trim_blocks/lstrip_blocks exactly as HF sets them.
BLOCKS_STYLE = """{% set ns = namespace(system='', turns=0) %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system = message.content.strip() %}
        {% continue %}
    {% endif %}
    {% if message.role not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message.role) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message.role == 'user' %}
[INST] {% if loop.last and ns.system %}{{ ns.system }}

{% endif %}{{ message.content.strip() }} [/INST]
    {% else %}
  {{ message.content.rstrip() }}{{ eos_token }}
    {% endif %}
    {% if message.content.startswith('STOP') %}
        {% break %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<turns={{ ns.turns }}>
{% endif %}
"""

FEATURES_STYLE = """{%- for message in messages -%}
{{ loop.index }}/{{ loop.length }} {{ message | tojson }}
{{ message.content | tojson }} {{ message.content.split() | length }} {{ message.content.upper() }} {{ message.content.replace(' ', '_') }}
{{ {'role': message.role, 'n': loop.index0, 'ok': true, 'nothing': none, 'list': [1, 2.5, 'x']} | tojson }}
{{ {'a': [1, {'b': 'q"\\n'}], 'c': {}, 'd': []} | tojson(indent=2) }}
{% if message.content.endswith('?') %}question{% elif 'hi' in message.content.lower() %}greeting{% else %}statement{% endif %}
{{ message.content.lstrip().title() }}|{{ message.content.count('o') }}|{{ message.content.find('o') }}|{{ message.content[:5] }}
{{ {'z': loop.index, 'a': 'é😀<&>'} | tojson(ensure_ascii=True, sort_keys=True) }} {{ [1, {'k': 'v'}] | tojson(separators=(',', ':')) }}
{% endfor %}
{%- if add_generation_prompt %}>>>{% endif %}"""

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "  You are a pirate.\n"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr, hi there!  "},
        {"role": "user", "content": "What's 2+2?"},
    ],
    "multilingual": [
        {"role": "user", "content": "Привет! 你好 \U0001f44b\U0001f3fd\n\tline two"},
        {"role": "assistant", "content": "\"Quoted\" \\ back\\slash \u00e9"},
        {"role": "user", "content": "STOP here? ok"},
        {"role": "assistant", "content": "never rendered by the blocks template"},
    ],
    "bad_alternation": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
    "tool_role": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": '{"temp": 21}'}],
    # transformers refuses an empty conversation before rendering; kvant mirrors that.
    "empty": [],
}


def make_chat(tok, smollm_template: str) -> None:
    templates = {
        "smollm2": smollm_template,
        "llama3_style": LLAMA3_STYLE,
        "blocks_style": BLOCKS_STYLE,
        "features_style": FEATURES_STYLE,
    }
    for name, template in templates.items():
        cases = []
        for conv_name, messages in CONVERSATIONS.items():
            for add_generation_prompt in (False, True):
                case = {"name": conv_name, "messages": messages, "add_generation_prompt": add_generation_prompt}
                try:
                    case["expected"] = tok.apply_chat_template(
                        messages,
                        chat_template=template,
                        tokenize=False,
                        add_generation_prompt=add_generation_prompt,
                    )
                except Exception as e:  # jinja2 TemplateError from raise_exception, or any render error
                    case["error"] = str(e)
                cases.append(case)
        dump_json(
            CHAT_DIR / f"{name}.json",
            {"template": template, "bos_token": tok.bos_token, "eos_token": tok.eos_token, "cases": cases},
        )
        print(f"chat {name}: {sum('error' in c for c in cases)} error cases of {len(cases)}")


# Hermes-style tool calling as Qwen 2.5 writes it: tools listed in the system turn, calls in
# <tool_call> tags with the arguments as a JSON object, results as <tool_response> in a user turn.
HERMES_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, today.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

TOOL_CONVERSATIONS = {
    "tools_offered": ([{"role": "user", "content": "Weather in Paris?"}], WEATHER_TOOLS),
    "no_tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "call_and_result": (
        [
            {"role": "user", "content": "Weather in Paris and the time?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
                    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        ],
        WEATHER_TOOLS,
    ),
}


def make_tool_chat(tok) -> None:
    """Tools and tool turns rendered by transformers (any tokenizer: only its special tokens matter)."""
    cases = []
    for conv_name, (messages, tools) in TOOL_CONVERSATIONS.items():
        for add_generation_prompt in (False, True):
            case = {"name": conv_name, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools}
            case["expected"] = tok.apply_chat_template(
                messages, tools=tools, chat_template=HERMES_TOOLS, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            cases.append(case)
    dump_json(
        CHAT_DIR / "hermes_tools.json",
        {"template": HERMES_TOOLS, "bos_token": tok.bos_token, "eos_token": tok.eos_token, "cases": cases},
    )
    print(f"chat hermes_tools: {len(cases)} cases")


STRFTIME_TIMES = [0, -1, 951782400, 951868799, 1721999109, 4102444799, -2208988800 - 12345, 1000000000]
STRFTIME_FORMATS = [
    "%d %b %Y",
    "%a %A %b %B %d %m %y %Y %j %H %I %M %S %p",
    "%-d %-m %-H %-I %-M %-S %-j %-y",
    "%F %T",
    "100%% at %H:%M",
]


def make_strftime() -> None:
    """strftime_now's formatting, checked on fixed UTC times against the C library."""
    cases = [
        {"unix": t, "format": f, "expected": time.strftime(f, time.gmtime(t))}
        for t in STRFTIME_TIMES
        for f in STRFTIME_FORMATS
    ]
    dump_json(CHAT_DIR / "strftime.json", cases)


def main() -> None:
    model_path = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("KVANT_MODEL", ""))
    if not model_path.is_file():
        sys.exit("usage: make_tokenizer_fixtures.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf (or set KVANT_MODEL)")
    smol = make_smollm2(model_path)
    make_spm()
    make_chat(smol["tokenizer"], smol["chat_template"])
    make_tool_chat(smol["tokenizer"])
    make_strftime()


if __name__ == "__main__":
    main()
