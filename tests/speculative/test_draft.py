import pytest
import torch

from reasoning_engine.speculative.draft import Draft


def tree() -> Draft:
    # root -> 0(a) -> 1(b) -> 3(d);  root -> 2(c);  0 -> 4(e)
    return Draft([10, 11, 12, 13, 14], [-1, 0, -1, 1, 0])


def test_path_helpers():
    draft = Draft.path([5, 6, 7])
    assert draft.parents == [-1, 0, 1]
    assert draft.is_path() and len(draft) == 3
    assert draft.depths() == [1, 2, 3]
    assert Draft.empty().is_path() and len(Draft.empty()) == 0


def test_tree_structure():
    draft = tree()
    assert not draft.is_path()
    assert draft.depths() == [1, 2, 1, 3, 2]
    assert draft.children() == [[0, 2], [1, 4], [3], [], [], []]
    assert draft.path_to(3) == [0, 1, 3]
    assert draft.leaves() == [2, 3, 4]


def test_ancestor_mask():
    mask = tree().ancestor_mask()
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    with_root = tree().ancestor_mask(include_root=True)
    assert with_root.shape == (6, 6)
    assert with_root[:, 0].all() and torch.equal(with_root[1:, 1:], expected)
    assert not with_root[0, 1:].any()


def test_match_and_accept():
    draft = tree()
    assert draft.match([10, 11, 13, 99]) == [0, 1, 3]
    assert draft.match([10, 14]) == [0, 4]
    assert draft.match([12, 10]) == [2]
    assert draft.match([99]) == []
    # Target argmax: after root 10, after node0 14, after node4 7 -> accepts 0, 4 and adds bonus 7.
    choices = [14, 0, 0, 0, 7]
    assert draft.accept(10, choices) == ([0, 4], 7)
    assert draft.accept(42, choices) == ([], 42)


def test_invalid_parents_rejected():
    with pytest.raises(ValueError):
        Draft([1, 2], [-1, 1])
    with pytest.raises(ValueError):
        Draft([1, 2], [-1])
    with pytest.raises(ValueError):
        Draft([1], [-2])


def test_node_probabilities_follow_truncation_and_subsets():
    draft = Draft([10, 11, 12, 13, 14], [-1, 0, -1, 1, 0], 2.0, [0.8, 0.5, 0.3, 0.2, 0.2])
    assert draft.truncated(3).probs == [0.8, 0.5, 0.3]
    kept = draft.subset([True, False, True, True, True])  # node 3 loses its parent 1
    assert kept.token_ids == [10, 12, 14] and kept.probs == [0.8, 0.3, 0.2]
    assert Draft.path([1, 2]).truncated(1).probs is None
    with pytest.raises(ValueError):
        Draft([1, 2], [-1, 0], 1.0, [0.5])
