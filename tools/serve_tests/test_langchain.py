"""LangChain's OpenAI adapters (langchain-openai) against a running `kvant serve`.

Run through run.sh, like test_openai_client.py: a chat model that invokes and
streams, a completion model whose batch() sends one request with a list of
prompts, structured output through OpenAI's json_schema response format, and
embeddings of documents and queries.
"""

import os

import pydantic
from langchain_openai import ChatOpenAI, OpenAI, OpenAIEmbeddings

BASE_URL = os.environ["KVANT_BASE_URL"]
API_KEY = os.environ["KVANT_API_KEY"]
MODEL = os.environ["KVANT_SERVED_MODEL"]


def chat_model(**kw):
    return ChatOpenAI(base_url=BASE_URL, api_key=API_KEY, model=MODEL, max_retries=0, **kw)


def test_chat_invoke_and_stream_agree():
    llm = chat_model(temperature=0, max_tokens=8)
    whole = llm.invoke("Say something about foxes.")
    assert isinstance(whole.content, str) and whole.content
    streamed = "".join(chunk.content for chunk in llm.stream("Say something about foxes."))
    assert streamed == whole.content


def test_completion_batch_is_one_request_of_many_prompts():
    llm = OpenAI(base_url=BASE_URL, api_key=API_KEY, model=MODEL, temperature=0, max_tokens=4, max_retries=0)
    prompts = ["The quick brown fox", "Once upon a time"]
    batch = llm.batch(prompts)
    assert batch == [llm.invoke(p) for p in prompts]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=30)
    kind: str = pydantic.Field(pattern="^(cat|dog|fish)$")


def test_structured_output_parses():
    llm = chat_model(temperature=1.0, max_tokens=150, seed=3).with_structured_output(Pet, method="json_schema")
    for _ in range(3):
        pet = llm.invoke("Invent a pet.")
        assert isinstance(pet, Pet)


def test_embeddings_documents_and_query():
    # Without the context-length check, which tokenizes with tiktoken (a
    # download) and sends token ids of OpenAI's vocabulary.
    emb = OpenAIEmbeddings(base_url=BASE_URL, api_key=API_KEY, model=MODEL, max_retries=0,
                           check_embedding_ctx_length=False)
    docs = emb.embed_documents(["The quick brown fox", "Once upon a time"])
    assert len(docs) == 2 and len(docs[0]) == len(docs[1]) > 0
    assert emb.embed_query("Once upon a time") == docs[1]
