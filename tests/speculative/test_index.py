from reasoning_engine.speculative.index import (SEGMENT_SHIFT, ContextStore, NgramIndex, common_suffix, power,
                                                prefix_hashes, window_key)


def key(tokens, n):
    prefix = prefix_hashes(tokens)
    return window_key(prefix, len(tokens), n, power(n))


def test_positions_follow_each_ngram_occurrence():
    index = NgramIndex([1, 2])
    segment = index.open_segment([5, 6, 5, 6, 7])
    base = segment << SEGMENT_SHIFT
    assert index.tables[1][key([5, 6], 2)] == [base | 2, base | 4]
    assert index.tables[0][key([7], 1)] == base | 5
    assert index.segments[segment] == [5, 6, 5, 6, 7] and index.num_tokens == 5


def test_ngrams_do_not_span_segments_and_drop_restores():
    index = NgramIndex([1, 2, 3])
    first = index.add_segment([1, 2, 3])
    second = index.add_segment([4, 1, 2])
    assert key([3, 4], 2) not in index.tables[1]
    assert index.tables[1][key([1, 2], 2)] == [(first << SEGMENT_SHIFT) | 2, (second << SEGMENT_SHIFT) | 3]
    index.drop_segment(first)
    assert index.tables[1][key([1, 2], 2)] == [(second << SEGMENT_SHIFT) | 3]
    index.drop_segment(second)
    assert index.num_tokens == 0 and all(not table for table in index.tables)


def test_window_key_is_position_independent():
    assert key([9, 1, 2, 3], 3) == key([1, 2, 3], 3) == key([7, 7, 1, 2, 3], 3)
    assert key([1, 2, 3], 3) != key([1, 2, 4], 3)


def test_common_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 8, 2, 3]
    assert common_suffix(tokens, 3, 7, 1, 3) == 3
    assert common_suffix(tokens, 3, 11, 1, 3) == 2


def test_context_store_reuses_a_finished_conversation():
    store = ContextStore([1, 2], reuse_capacity=2)
    store.start("a", [1, 2, 3])
    finished = store.sync("a", [1, 2, 3, 4, 5])
    assert store.finish("a") == (3, [1, 2, 3, 4, 5])
    store.start("b", [1, 2, 3, 4, 5, 6])
    reused = store.get("b")
    assert reused is finished and reused.tokens == [1, 2, 3, 4, 5, 6] and reused.prompt_len == 6
    store.start("c", [1, 2, 3, 4, 5, 6])
    assert store.get("c") is not reused


def test_context_store_indexes_a_prompt_only_when_first_asked() -> None:
    """A request that never drafts never has its prompt indexed, and leaves nothing to reuse."""
    store = ContextStore([1, 2], reuse_capacity=2)
    store.start("a", [1, 2, 3])
    assert not store.active
    assert store.finish("a") == (3, [1, 2, 3])
    assert not store.active and not store._finished
    store.start("b", [1, 2, 3, 4])
    assert store.sync("b", [1, 2, 3, 4, 5]).tokens == [1, 2, 3, 4, 5] and store.get("b").prompt_len == 4


def test_bulk_append_builds_the_same_tables_as_token_by_token():
    import random

    from reasoning_engine.speculative.index import BULK_MIN

    rng = random.Random(0)
    tokens = [rng.randrange(40) for _ in range(5 * BULK_MIN)] + [2**40 + 7, 0, 0, 0]
    one_by_one, bulk = NgramIndex([1, 2, 3, 5, 8]), NgramIndex([1, 2, 3, 5, 8])
    a, b = one_by_one.open_segment(), bulk.open_segment()
    for t in tokens:
        one_by_one.append(a, [t])
    bulk.append(b, tokens[:3])  # a short start, then a bulk append that reaches back into it
    bulk.append(b, tokens[3:])
    assert one_by_one.tables == bulk.tables and one_by_one.prefixes == bulk.prefixes
    assert one_by_one.num_tokens == bulk.num_tokens == len(tokens)
