"""The router's prompt blocks: chained hashes over the canonical prompt text, a bounded LRU per replica."""

from __future__ import annotations

import hashlib

import pytest

from reasoning_engine.router.prefix import PrefixIndex, block_hashes, prompt_text

SYSTEM = {"role": "system", "content": "You are an airline agent. " * 20}


def test_a_longer_conversation_shares_the_shorter_ones_blocks() -> None:
    first = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "book a flight " * 10}]}
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "which date?"},
                                    {"role": "user", "content": "tomorrow"}]}
    short, long = block_hashes(prompt_text(first), 16), block_hashes(prompt_text(second), 16)
    assert len(short) > 10 and long[:len(short)] == short
    other = {"model": "m", "messages": [{"role": "system", "content": "Another agent."}, *first["messages"][1:]]}
    assert block_hashes(prompt_text(other), 16)[0] != short[0]  # chained: a different start differs everywhere


def test_blocks_are_chained_sha256_of_full_blocks() -> None:
    hashes = block_hashes("abcdefghij", 4)  # "ij" is a partial block: not hashed
    first = hashlib.sha256(b"abcd").digest()
    assert hashes == [first, hashlib.sha256(first + b"efgh").digest()]
    with pytest.raises(ValueError, match="block_chars"):
        block_hashes("abc", 0)


def test_prompt_text_reads_every_api_and_ignores_sampling_fields() -> None:
    assert prompt_text({"prompt": "hello", "temperature": 0}) == prompt_text({"prompt": "hello", "temperature": 1})
    assert "be brief" in prompt_text({"instructions": "be brief", "input": "hi"})
    assert "be brief" in prompt_text({"system": "be brief", "messages": [{"role": "user", "content": "hi"}]})
    assert prompt_text([1, 2]) == "" and prompt_text({"model": "m"}) == ""


def test_the_index_matches_prefixes_and_stays_bounded() -> None:
    index = PrefixIndex(max_blocks=8)
    a = block_hashes("a" * 64, 8)  # 8 blocks
    index.add(a)
    assert index.matched(a) == 8 and index.matched(a[:3]) == 3
    b = block_hashes("b" * 32, 8)  # 4 more: 4 of a's leave, its deepest first, so a's first blocks still match
    index.add(b)
    assert len(index) == 8 and index.matched(b) == 4 and index.matched(a) == 4
    for i in range(100):  # whatever clients send, the index holds at most max_blocks
        index.add(block_hashes(str(i) * 64, 8))
    assert len(index) == 8
