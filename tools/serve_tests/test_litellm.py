"""LiteLLM's OpenAI-compatible provider against a running `kvant serve`.

Run through run.sh, like test_openai_client.py: LiteLLM addresses the server
as `openai/<served name>` with its base URL, and chats (whole and streamed),
completes text, embeds and asks for JSON-schema output through it.
"""

import json
import os

# LiteLLM fetches its model price map from GitHub at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402

BASE_URL = os.environ["KVANT_BASE_URL"]
API_KEY = os.environ["KVANT_API_KEY"]
MODEL = "openai/" + os.environ["KVANT_SERVED_MODEL"]
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
ARGS = dict(model=MODEL, api_base=BASE_URL, api_key=API_KEY, num_retries=0)


def test_chat_whole_and_streamed_agree():
    whole = litellm.completion(messages=MESSAGES, max_tokens=8, temperature=0, **ARGS)
    text = whole.choices[0].message.content
    assert isinstance(text, str) and text
    assert whole.usage.completion_tokens > 0
    stream = litellm.completion(messages=MESSAGES, max_tokens=8, temperature=0, stream=True, **ARGS)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert streamed == text


def test_text_completion():
    r = litellm.text_completion(prompt="The quick brown fox", max_tokens=4, temperature=0, **ARGS)
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 4


def test_embedding():
    r = litellm.embedding(input=["The quick brown fox", "Once upon a time"], **ARGS)
    vecs = [d["embedding"] for d in r.data]
    assert len(vecs) == 2 and len(vecs[0]) == len(vecs[1]) > 0
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-4


def test_json_schema_response_format():
    schema = {
        "type": "object",
        # A bounded age: an unbounded integer lets a sampled run emit digits
        # until max_tokens (seen once after a numerics change: 80 tokens of
        # "age" and no closing brace), whatever the server does right.
        "properties": {"name": {"type": "string", "maxLength": 10},
                       "age": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    r = litellm.completion(messages=MESSAGES, max_tokens=80, temperature=1.0, seed=3,
                           response_format=fmt, **ARGS)
    pet = json.loads(r.choices[0].message.content)
    assert set(pet) == {"name", "age"} and isinstance(pet["age"], int)
    assert 0 <= pet["age"] <= 999
