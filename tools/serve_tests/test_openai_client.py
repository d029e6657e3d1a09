"""The official `openai` client against a running `kvant serve`.

Run through run.sh, which starts the server and sets KVANT_BASE_URL,
KVANT_API_KEY and KVANT_SERVED_MODEL. Requests use `ignore_eos` (a kvant
extension, sent with `extra_body`) where a test needs an exact length.
"""

import os

import openai
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
        assert bytes(entry.bytes) == entry.token.encode()
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
        ({"echo": True}, "echo"),
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
