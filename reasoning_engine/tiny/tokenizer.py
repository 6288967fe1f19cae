"""Builds the tiny model's byte-level BPE tokenizer (HF tokenizers format) from the synthetic corpus.

Design, chosen for a model that must do digit arithmetic and spell words:
- every digit is its own token, and a number never merges with the space before it;
- text is split into pieces of letters with at most one leading non-letter character (a space, newline, quote or
  bracket) and runs of punctuation; the only merges are whole frequent pieces, built as left-to-right chains from
  their first character, so a merge can only fire at the start of a piece;
- frequent pieces are chosen by how many tokens they save on the corpus, except pieces opening with a single quote:
  a word quoted as in ``'strawberry'`` therefore always tokenizes one letter per token (the letter-counting task);
- a handful of bare lower-case words that open a text segment (the role names after ``<|im_user|>`` etc.) get chains
  too; the letter-counting word list avoids their first pairs (data.letter_count_words);
- the turn tokens are special (dropped by ``skip_special_tokens``), while ``<think>``, ``</think>`` and Kimi's
  tool-call section tokens are single added tokens that are not special, so they survive any decode.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from reasoning_engine.tiny.chat_format import (
    BARE_WORDS,
    CHAT_TEMPLATE,
    IM_END,
    PAD,
    SPECIAL_TOKENS,
    TEXT_CONTROL_TOKENS,
)
from reasoning_engine.tiny.data import training_sample

# One digit | optional single non-alphanumeric char + letters | punctuation run not touching a following letter |
# whitespace (GPT-2 style: a run's last space joins the next piece).
PIECE_PATTERN = r"\p{N}|[^\p{L}\p{N}]?\p{L}+| ?[^\s\p{L}\p{N}]+(?!\p{L})|\s+(?!\S)|\s+"
VOCAB_SIZE = 1024


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def _chain(piece: str) -> list[tuple[str, str]]:
    return [(piece[:i], piece[i]) for i in range(1, len(piece))]


def _mergeable(piece: str) -> bool:
    """Pieces whose chains cannot fire inside a quoted word: they open with a non-letter other than the quote, or
    with a capital letter, and contain no digits."""
    first = chr(CHAR_TO_BYTE[piece[0]])
    if len(piece) < 2 or any(ch.isdigit() for ch in piece) or first == "'":
        return False
    return not first.isalpha() or first.isupper()


def count_pieces(texts: list[str]) -> Counter[str]:
    """Byte-level pieces of texts, with the added tokens cut out first (as the tokenizer does)."""
    import re

    split = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TEXT_CONTROL_TOKENS))
    pre = pre_tokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        for segment in split.split(text):
            if segment:
                counts.update(p for p, _ in pre.pre_tokenize_str(segment))
    return counts


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Vocabulary: added tokens (ids 0..12), the 256 byte symbols, then merge chains of the most useful pieces."""
    added = SPECIAL_TOKENS + TEXT_CONTROL_TOKENS
    vocab: dict[str, int] = {}
    for tok in added + [BYTE_TO_CHAR[b] for b in range(256)]:
        vocab[tok] = len(vocab)
    counts = count_pieces(texts)
    ranked = sorted(
        (p for p in counts if _mergeable(p)),
        key=lambda p: (-counts[p] * (len(p) - 1), p),
    )
    prefixed: list[tuple[str, str]] = []
    for piece in ranked:
        new = [m for m in _chain(piece) if m[0] + m[1] not in vocab]
        if len(vocab) + len(new) > vocab_size - sum(len(w) - 1 for w in BARE_WORDS):
            continue
        for left, right in new:
            vocab[left + right] = len(vocab)
            prefixed.append((left, right))
    bare: list[tuple[str, str]] = []
    for word in BARE_WORDS:
        for left, right in _chain(word):
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                bare.append((left, right))
    # Prefixed merges rank first, so a piece's own chain always completes before any bare-letter merge can fire.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=prefixed + bare, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_CONTROL_TOKENS])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json: fast tokenizer class, eos/pad, the chat template, and which added tokens are special."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (IM_END, PAD)],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    with open(out_dir / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(model_max_length), f, indent=2, ensure_ascii=False)
        f.write("\n")


def corpus_for_vocab(num_samples: int, seed: int) -> list[str]:
    """Rendered training conversations (prompt + completion) used to pick the merges."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_samples):
        s = training_sample(rng)
        out.append(s.prompt() + s.completion())
    return out
