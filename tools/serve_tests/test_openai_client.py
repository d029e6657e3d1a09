"""The official `openai` client against a running `kvant serve`.

Run through run.sh, which starts the server and sets KVANT_BASE_URL,
KVANT_API_KEY and KVANT_SERVED_MODEL. Requests use `ignore_eos` (a kvant
extension, sent with `extra_body`) where a test needs an exact length.
"""

import json
import os
import urllib.request
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

BASE_URL = os.environ["KVANT_BASE_URL"]
API_KEY = os.environ["KVANT_API_KEY"]
MODEL = os.environ["KVANT_SERVED_MODEL"]
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0)


def chat(client, **kw):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=EXACT)
    args.update(kw)
    return client.chat.completions.create(**args)


def complete(client, **kw):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=EXACT)
    args.update(kw)
    return client.completions.create(**args)


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]


def test_chat_streamed_matches_non_streamed(client):
    resp = chat(client)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8

    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_streamed_matches_non_streamed(client):
    resp = complete(client)
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    chunks = list(complete(client, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == resp.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs(client):
    lp = complete(client, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0
        assert 1 <= len(top) <= 2
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)


def test_chat_logprobs(client):
    content = chat(client, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        # Exact bytes: a token ending inside a character shows U+FFFD as text.
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob
    streamed = [
        e
        for c in chat(client, logprobs=True, top_logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]


def test_n_choices(client):
    resp = chat(client, n=3, temperature=1.0, seed=11)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 24
    # Choice i samples with seed + i.
    again = chat(client, temperature=1.0, seed=12)
    assert again.choices[0].message.content == resp.choices[1].message.content
    finished = {}
    for c in complete(client, n=2, stream=True, temperature=1.0, seed=3):
        for ch in c.choices:
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "length", 1: "length"}


def test_stop(client):
    text = complete(client, max_tokens=32).choices[0].text
    # A two-character stop string whose first occurrence is past the start.
    cut = next(
        i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i
    )
    resp = complete(client, max_tokens=32, stop=[text[cut : cut + 2], "\x01never"])
    assert resp.choices[0].text == text[:cut]
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 10**7}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
                }
            },
            "response_format",
        ),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_errors_are_bad_requests(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 50}, "logprobs"),
        ({"suffix": "tail"}, "suffix"),
    ],
)
def test_completion_errors_are_bad_requests(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **kw)
    assert e.value.body["param"] == param


def test_unknown_model_and_bad_key(client):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-nothing")
    assert e.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=BASE_URL, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# A schema whose every field is bounded, so that a sampled output always
# completes inside the context (no max_tokens: the rest of the context, 212
# tokens with the 256-token fixture; at worst, every character a 6-byte
# \uXXXX escape, this takes about 190).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "ja", "sw"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": ["string", "null"], "maxLength": 4}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "languages", "address", "verified"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PERSON_MESSAGES = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


def test_json_schema_outputs_always_validate(client):
    """Sampled at temperature 1, every output parses and validates (an
    independent validator, not the grammar engine that made it)."""
    samples = int(os.environ.get("KVANT_STRUCTURED_SAMPLES", "64"))
    checked = 0
    for i in range(-(-samples // 16)):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=PERSON_MESSAGES,
            response_format=PERSON_FORMAT,
            temperature=1.0,
            seed=1000 + 16 * i,
            n=16,
        )
        for c in resp.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), PERSON)
            checked += 1
    assert checked >= samples


def test_json_schema_streamed_matches_non_streamed(client):
    args = dict(model=MODEL, messages=PERSON_MESSAGES, response_format=PERSON_FORMAT, temperature=1.0, seed=77)
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args) if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_json_object_and_pydantic_parse(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=PERSON_MESSAGES, response_format={"type": "json_object"}, temperature=0, max_tokens=64
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:
        assert resp.choices[0].message.content.startswith("{")

    class Forecast(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        days: int = pydantic.Field(ge=1, le=14)
        unit: Literal["celsius", "fahrenheit"]

    chat_api = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in range(4):
        parsed = chat_api(
            model=MODEL, messages=MESSAGES, response_format=Forecast, temperature=1.0, seed=seed, max_tokens=200
        )
        assert isinstance(parsed.choices[0].message.parsed, Forecast)


def test_guided_choice_and_regex(client):
    choices = ["yes", "no", "maybe (later)"]
    for seed in range(8):
        r = complete(client, temperature=1.0, seed=seed, max_tokens=16, extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices
        assert r.choices[0].finish_reason == "stop"
    r = complete(client, temperature=1.0, seed=3, max_tokens=32, extra_body={"guided_regex": "[0-9]{3}-[A-Z]{2}"})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"


def test_prompt_list_echo_best_of_and_logit_bias(client):
    """What LangChain's batch() and older completion clients send."""
    prompts = [PROMPT, "Once upon a time"]
    batch = complete(client, prompt=prompts, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1]
    for i, p in enumerate(prompts):
        assert batch.choices[i].text == complete(client, prompt=p, max_tokens=4).choices[0].text
    echoed = complete(client, echo=True, max_tokens=4)
    assert echoed.choices[0].text == PROMPT + complete(client, max_tokens=4).choices[0].text
    best = complete(client, best_of=3, n=2, temperature=1.0, seed=5, max_tokens=4)
    assert len(best.choices) == 2
    assert best.usage.completion_tokens == 12
    # logit_bias +100 on the token of "a" makes it every greedy choice.
    root = BASE_URL.removesuffix("/v1")
    req = urllib.request.Request(
        root + "/tokenize",
        json.dumps({"prompt": "a", "add_special_tokens": False}).encode(),
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        ids = json.load(r)["tokens"]
    assert len(ids) == 1
    forced = complete(client, max_tokens=3, logit_bias={str(ids[0]): 100})
    assert forced.choices[0].text == "aaa"


def test_embeddings(client):
    """The client asks for base64 unless told otherwise; both carry the same
    unit-length vectors, in input order, with the prompt tokens as usage."""
    texts = ["The quick brown fox", "jumps over the lazy dog", PROMPT]
    default = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2]
    for a, b in zip(default.data, floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
        assert sum(x * x for x in b.embedding) == pytest.approx(1.0, abs=1e-4)
    assert floats.data[0].embedding == floats.data[2].embedding
    assert floats.data[0].embedding != floats.data[1].embedding
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    one = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    assert one.data[0].embedding == floats.data[1].embedding
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="")
    assert e.value.body["param"] == "input"
