"""Prefix-cache keys: each full block is named by SHA-256 over an unambiguous encoding of its parent's key,
its tokens, its media and (through the first block) the prompt's cache_salt, so no crafted prompt takes another's KV;
prompts share cached blocks only under equal salts. Engine-level cases run the bundled model."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.engine.kv_cache import MAX_CACHE_SALT_LENGTH, BlockManager, prefix_hashes
from reasoning_engine.engine.request import Request
from reasoning_engine.multimodal.inputs import MediaItem

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

# Two 16-token blocks (ids of the bundled model's plain vocabulary) whose CPython tuple hashes are equal: the old key of
# a first block, hash((None, tuple(block))), was the same 64-bit number for both, so B's prompt read A's KV. Found in
# about a minute of numpy: a birthday search over 3.3e8 blocks (tokens 0-2 varied, 3-14 fixed) on acc * P2^-1 after
# token 14 of the xxHash-style tuple hash; two states within 908 of each other are evened out by token 15.
COLLIDING_A = [253, 253, 247, 442, 477, 698, 876, 44, 143, 760, 874, 239, 296, 802, 397, 205]
COLLIDING_B = [67, 562, 94, 442, 477, 698, 876, 44, 143, 760, 874, 239, 296, 802, 397, 13]


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "little")


def _i64(n: int) -> bytes:
    return n.to_bytes(8, "little", signed=True)


def documented_root(salt: str | None) -> bytes:
    """The first block's parent, built from kv_cache's documented encoding (not from its code)."""
    domain = b"reasoning-engine kv-prefix v1\0"
    if salt is None:
        return hashlib.sha256(domain + b"\0").digest()
    encoded = salt.encode()
    return hashlib.sha256(domain + b"\1" + _u32(len(encoded)) + encoded).digest()


def documented_key(parent: bytes, tokens: list[int], media: list[tuple[str, int]] = ()) -> bytes:
    data = parent + _u32(len(tokens)) + b"".join(_i64(t) for t in tokens) + _u32(len(media))
    data += b"".join(_i64(start) + _u32(len(h)) + h.encode() for h, start in media)
    return hashlib.sha256(data).digest()


def _request(tokens: list[int], salt: str | None = None, media: tuple[MediaItem, ...] = ()) -> Request:
    return Request("r", "r", 0, None, tokens, SamplingParams(max_tokens=1), frozenset(), media=media, cache_salt=salt)


def _keys(tokens: list[int], salt: str | None = None, media: tuple[MediaItem, ...] = ()) -> list[bytes]:
    """The keys a BlockManager registers for a prompt whose tokens are all computed."""
    bm = BlockManager(num_blocks=8, block_size=16)
    request = _request(tokens, salt, media)
    bm.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request)
    keys = bm.full_block_keys(request)
    assert all(bm.cached[key] == block for key, block in zip(keys, request.block_table))
    return keys


def _image(content_hash: str, offset: int, length: int) -> MediaItem:
    return MediaItem("image", content_hash, offset, length, torch.zeros(1), (1, 1, 1))


def test_block_keys_are_sha256_of_their_documented_encoding() -> None:
    tokens = list(range(100, 140))
    first = documented_key(documented_root(None), tokens[:16])
    assert _keys(tokens) == [first, documented_key(first, tokens[16:32])]
    salted = documented_key(documented_root("tenant-a"), tokens[:16])
    assert _keys(tokens, "tenant-a") == [salted, documented_key(salted, tokens[16:32])]
    # an image whose placeholders run from position 10 to 21: both blocks key on it, the second with a start of -6
    image = _image("ab" * 16, offset=10, length=12)
    with_image = documented_key(documented_root(None), tokens[:16], [("ab" * 16, 10)])
    assert _keys(tokens, media=(image,)) == [with_image, documented_key(with_image, tokens[16:32], [("ab" * 16, -6)])]
    # data-parallel routing names a prompt's blocks the same way (all but the last token's block)
    assert prefix_hashes(tokens[:33], 16, (image,), "t") == _keys(tokens[:32], "t", (image,))


def test_any_change_to_what_the_kv_depends_on_changes_the_key() -> None:
    tokens = list(range(200, 216))
    root = documented_root(None)
    variants = {documented_key(root, tokens)}
    for position in range(16):
        changed = list(tokens)
        changed[position] += 1
        variants.add(documented_key(root, changed))
    variants |= {documented_key(documented_root("a"), tokens), documented_key(documented_root("b"), tokens),
                 documented_key(hashlib.sha256(b"another parent").digest(), tokens),
                 documented_key(root, tokens, [("ab" * 16, 3)]), documented_key(root, tokens, [("cd" * 16, 3)]),
                 documented_key(root, tokens, [("ab" * 16, 4)]), documented_key(root, tokens[:15])}
    assert len(variants) == 17 + 7
    keys = {tuple(_keys(tokens + [1])), tuple(_keys(tokens + [1], "a")), tuple(_keys(tokens + [1], "b")),
            tuple(_keys(tokens + [1], media=(_image("ab" * 16, 3, 2),))),
            tuple(_keys(tokens + [1], media=(_image("cd" * 16, 3, 2),))),
            tuple(_keys(tokens + [1], media=(_image("ab" * 16, 4, 2),)))}
    assert len(keys) == 6


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(dtype="float32", device="cpu", max_model_len=256, kv_cache_blocks=64, block_size=16)


def _generate(llm: LLM, tokens: list[int], salt: str | None = None, params: SamplingParams = GREEDY):
    prompt = {"prompt_token_ids": tokens} if salt is None else {"prompt_token_ids": tokens, "cache_salt": salt}
    return llm.generate(prompt, params)[0]


def test_blocks_that_collided_under_pythons_hash_keep_their_own_kv(llm: LLM) -> None:
    assert COLLIDING_A != COLLIDING_B and hash(tuple(COLLIDING_A)) == hash(tuple(COLLIDING_B))
    tail = [20, 30, 40]
    b_alone = _generate(llm, COLLIDING_B + tail, "b alone").outputs[0].token_ids  # a salt of its own: nothing to hit
    a = _generate(llm, COLLIDING_A + tail, "a then b")
    b = _generate(llm, COLLIDING_B + tail, "a then b")
    assert a.outputs[0].token_ids != b_alone  # so reading A's KV would show
    assert b.num_cached_tokens == 0
    assert b.outputs[0].token_ids == b_alone


def test_cache_salt_shares_blocks_only_under_the_same_salt(llm: LLM) -> None:
    prompt = list(range(300, 340))  # two full blocks and a tail, sent by no other test
    runs = [(salt, _generate(llm, prompt, salt)) for salt in ("tenant-a", "tenant-a", "tenant-b", None, None)]
    assert [(salt, out.num_cached_tokens) for salt, out in runs] == [
        ("tenant-a", 0), ("tenant-a", 32), ("tenant-b", 0), (None, 0), (None, 32)]
    assert len({tuple(out.outputs[0].token_ids) for _, out in runs}) == 1
    bm = llm.engine.block_manager
    hits = bm.prefix_hits
    _generate(llm, prompt, "tenant-c", SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    assert bm.prefix_hits - hits == 2 * 32  # samples 1 and 2 share sample 0's blocks under its salt
    chat = [{"role": "user", "content": "What is 347 + 589? Show the sum digit by digit, please."}]
    cached = [llm.chat(chat, GREEDY, cache_salt=salt)[0].num_cached_tokens for salt in ("x", "x", "y")]
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] == 0


@pytest.mark.parametrize("salt,why", [("", "must be 1 to"), ("s" * (MAX_CACHE_SALT_LENGTH + 1), "must be 1 to"),
                                      (5, "must be a string"), (b"tenant", "must be a string")])
def test_a_bad_cache_salt_is_a_value_error_naming_it(llm: LLM, salt: object, why: str) -> None:
    with pytest.raises(ValueError, match=f"cache_salt: {why}"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "cache_salt": salt}, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_longest_salt_and_a_lone_surrogate_are_salts_like_any_other(llm: LLM) -> None:
    for salt in ("s" * MAX_CACHE_SALT_LENGTH, "\ud800"):
        assert _generate(llm, list(range(400, 420)), salt).num_cached_tokens == 0
        assert _generate(llm, list(range(400, 420)), salt).num_cached_tokens == 16
