"""Logprob `bytes` are each token's own bytes, whatever way the vocabulary spells bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reasoning_engine.server.token_bytes import TokenBytes

from .helpers import save_byte_level_tokenizer


def _bytes_of(tokenizer: Any, text: str) -> list[list[int]]:
    token_bytes = TokenBytes(tokenizer)
    return [token_bytes(i, tokenizer.decode([i])) for i in tokenizer.encode(text, add_special_tokens=False)]


def test_byte_level_tokens_and_added_tokens(tmp_path: Path) -> None:
    tokenizer = save_byte_level_tokenizer(tmp_path)
    tokenizer.add_tokens(["é!"])
    assert _bytes_of(tokenizer, "a—") == [[0x61], [0xE2], [0x80], [0x94]]
    assert _bytes_of(tokenizer, "é!<think>") == [list("é!".encode()), list(b"<think>")], "added tokens: their text"


def test_sentencepiece_byte_fallback() -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert tokenizer.convert_ids_to_tokens(2 + 0x80) == "<0x80>" and tokenizer.decode([2 + 0x80]) == "\ufffd"
    assert _bytes_of(tokenizer, "a—") == [[0x61], [0xE2], [0x80], [0x94]]


def test_plain_text_vocabulary_gives_the_decoded_text(kimi_tokenizer: Any) -> None:
    assert _bytes_of(kimi_tokenizer, "a <think>") == [[0x61], [0x20], list(b"<think>")]
    assert TokenBytes(None)(7, "7") == [0x37]
