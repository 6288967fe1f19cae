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


def test_truncate_leaves_the_tables_of_the_kept_tokens_alone():
    import random

    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(300)]
    later = [rng.randrange(6) for _ in range(40)]
    for length in (0, 1, 5, 150, 299, 300):
        cut = NgramIndex([1, 2, 3, 8])
        segment = cut.open_segment(tokens)
        cut.add_segment(later)  # its positions follow the cut segment's in shared lists
        cut.truncate(segment, length)
        fresh = NgramIndex([1, 2, 3, 8])
        fresh.open_segment(tokens[:length])
        fresh.add_segment(later)
        assert cut.tables == fresh.tables, length
        assert cut.segments == fresh.segments and cut.prefixes == fresh.prefixes
        assert cut.num_tokens == fresh.num_tokens == length + len(later)


def test_context_store_reuses_the_shared_part_of_a_finished_turn():
    """The next turn's prompt re-renders the end of the last reply (here its last two tokens): the finished context
    is cut back to the shared part and extended, and indexes what a fresh one would."""
    store = ContextStore([1, 2, 4], reuse_capacity=2)
    store.start("a", [1, 2, 3, 4])
    finished = store.sync("a", [1, 2, 3, 4, 5, 6, 7, 8])
    store.finish("a")
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 9]
    store.start("b", prompt)
    assert store.unseen("b", len(prompt)) == 2 + 3  # two tokens dropped, three appended, not nine indexed
    reused = store.get("b")
    assert reused is finished and reused.tokens == prompt and reused.prompt_len == len(prompt)
    fresh = ContextStore([1, 2, 4])
    fresh.start("c", prompt)
    assert reused.index.tables == fresh.get("c").index.tables


def test_context_store_indexes_afresh_when_less_than_half_a_finished_turn_is_shared():
    store = ContextStore([1, 2], reuse_capacity=2)
    store.start("a", [1, 2, 3, 4, 5, 6])
    finished = store.sync("a", [1, 2, 3, 4, 5, 6])
    store.finish("a")
    store.start("b", [1, 2, 3, 7, 7, 7])
    assert store.unseen("b", 6) == 6
    assert store.get("b") is not finished and store._finished == [finished]


def test_common_prefix():
    from reasoning_engine.speculative.index import common_prefix

    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([7], [1]) == 0 and common_prefix([], [1]) == 0
    long = list(range(1000))
    assert common_prefix(long, long[:777] + [0]) == 777


def test_context_store_keeps_finished_turns_within_its_token_cap():
    store = ContextStore([1, 2], reuse_capacity=8, reuse_max_tokens=10)
    for name, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8]), ("c", [9, 10, 11, 12]), ("d", list(range(20, 31)))):
        store.start(name, prompt)
        store.get(name)
        store.finish(name)
    assert [c.tokens for c in store._finished] == []  # "d" alone is over the cap; "a" went when "c" came
    store.start("e", [5, 6, 7, 8, 9])
    store.get("e")
    store.finish("e")
    store.start("f", [9, 10, 11, 12])
    store.get("f")
    store.finish("f")
    assert [c.tokens for c in store._finished] == [[5, 6, 7, 8, 9], [9, 10, 11, 12]]
