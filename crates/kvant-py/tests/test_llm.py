"""kvant.LLM: load a checkpoint and generate or stream from Python."""

import json
import os

import pytest

import kvant


@pytest.fixture(scope="module")
def llm(repo_root):
    return kvant.LLM(os.path.join(repo_root, "tests/fixtures/models/llama-gqa"))


def test_tokenize_matches_the_reference(llm, repo_root):
    ref = json.load(open(os.path.join(repo_root, "tests/fixtures/models/llama-gqa/reference.json")))
    assert llm.tokenize(ref["prompt_text"]) == ref["prompt_ids"]
    assert llm.info()["layers"] > 0


def test_generate_and_stream_agree(llm):
    text = llm.generate("At 6:45 the keeper", max_tokens=12)
    pieces = list(llm.stream("At 6:45 the keeper", max_tokens=12))
    assert "".join(pieces) == text
    assert len(pieces) >= 1


def test_bad_arguments(llm, tmp_path):
    with pytest.raises(ValueError):
        llm.generate("hi", max_tokens=0)
    with pytest.raises(ValueError):
        llm.generate("hi", temperature=-1.0)
    with pytest.raises(ValueError):
        kvant.LLM(str(tmp_path / "missing"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError):
        kvant.LLM(str(bad))
