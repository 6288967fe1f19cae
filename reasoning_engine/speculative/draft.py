"""Draft trees and the proposer interface.

A draft is a small tree of guessed tokens hanging below the last token already in the sequence (the root). The target
model verifies every node in one forward pass: each node attends to the context, the root and its own ancestors, and
sits at position root_position + depth. A path draft (parents [-1, 0, 1, ...]) is the degenerate tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Draft:
    """Nodes in topological order: `parents[i] < i`, and -1 means the node hangs directly below the root.

    `score` is the proposer's own estimate of how many of these tokens the target will accept (0 when it has none);
    a hybrid proposer compares it across methods. `probs`, where the proposer has them, are each node's probability
    that the target accepts the path down to it (their sum is the score); the adaptive engine chooses how much of a
    draft to verify from them.
    """

    token_ids: list[int]
    parents: list[int]
    score: float = 0.0
    probs: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"token_ids and parents differ in length: {len(self.token_ids)} != {len(self.parents)}")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must be -1 or an earlier node")
        if self.probs is not None and len(self.probs) != len(self.token_ids):
            raise ValueError(f"probs and token_ids differ in length: {len(self.probs)} != {len(self.token_ids)}")

    @classmethod
    def path(cls, token_ids: Sequence[int], score: float = 0.0) -> Draft:
        """A chain: each token follows the previous one."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), score)

    @classmethod
    def empty(cls) -> Draft:
        return cls([], [])

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, length: int) -> Draft:
        """The first `length` nodes: still a tree, since every node's parent comes before it."""
        if length >= len(self.token_ids):
            return self
        probs = self.probs[:length] if self.probs is not None else None
        return Draft(self.token_ids[:length], self.parents[:length], min(self.score, float(length)), probs)

    def subset(self, keep: Sequence[bool]) -> Draft:
        """The nodes marked in `keep` whose ancestors are all kept too (still a tree), renumbered."""
        index: dict[int, int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for node, kept in enumerate(keep):
            parent = self.parents[node]
            if kept and (parent < 0 or parent in index):
                index[node] = len(tokens)
                tokens.append(self.token_ids[node])
                parents.append(index[parent] if parent >= 0 else -1)
        if len(tokens) == len(self.token_ids):
            return self
        probs = [self.probs[node] for node in index] if self.probs is not None else None
        return Draft(tokens, parents, min(self.score, float(len(tokens))), probs)

    def is_path(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def first_path(self) -> Draft:
        """The chain from the root through each node's first child: what a model that verifies only chains
        (DeepSeek-V4) is given of a tree."""
        keep, last = [], -1
        for node, parent in enumerate(self.parents):
            keep.append(parent == last)
            if parent == last:
                last = node
        return self.subset(keep)

    def depths(self) -> list[int]:
        """Edges from the root: a child of the root has depth 1, so its position is root_position + 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self) -> list[list[int]]:
        """children()[i + 1] lists the children of node i; children()[0] those of the root."""
        kids: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (inclusive)."""
        nodes: list[int] = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(len(self.parents)) if i not in has_child]

    def ancestor_mask(self, include_root: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool [N, N] (or [N+1, N+1] with the root as row/column 0): mask[i, j] is True when j is i or an ancestor.

        This is what the verifier puts in ForwardBatch.tree_mask for the step's query tokens of this sequence.
        """
        import torch

        offset = 1 if include_root else 0
        size = len(self.parents) + offset
        mask = torch.zeros(size, size, dtype=torch.bool)
        if include_root:
            mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            row = i + offset
            if parent >= 0:
                mask[row] |= mask[parent + offset]
            mask[row, row] = True
        return mask.to(device) if device is not None else mask

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The longest root path whose tokens equal `tokens[0], tokens[1], ...`; returns its node indices.

        Greedy verification when the target's choice does not depend on the branch (offline replay of a recorded output).
        """
        kids = self.children()
        accepted: list[int] = []
        current = -1
        for token in tokens:
            nxt = next((c for c in kids[current + 1] if self.token_ids[c] == token), None)
            if nxt is None:
                break
            accepted.append(nxt)
            current = nxt
        return accepted

    def accept(self, root_choice: int, node_choices: Sequence[int]) -> tuple[list[int], int]:
        """Verification (speculative/verify.py): `root_choice` is the target's pick after the root (its argmax, or
        its draw), `node_choices[i]` after node i. Follows the child equal to each pick.

        Returns the accepted node indices and the bonus token (the target's choice after the last accepted node).
        """
        kids = self.children()
        accepted: list[int] = []
        current, choice = -1, root_choice
        while True:
            nxt = next((c for c in kids[current + 1] if self.token_ids[c] == choice), None)
            if nxt is None:
                return accepted, choice
            accepted.append(nxt)
            current, choice = nxt, node_choices[nxt]


@runtime_checkable
class Proposer(Protocol):
    """What the engine calls, per request, around each verify step.

    `propose` receives the request's full sequence (prompt plus accepted output); a proposer that keeps an index brings
    it up to date from that sequence, so `on_tokens_accepted` is an early, off-the-critical-path update, not a duty.
    The engine calls it only after steps that verified a draft; `finish_request` gets the whole sequence again, so a
    proposer that learns from finished outputs sees the tokens decoded without a draft too.
    """

    method: str

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft: ...

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None: ...

    def finish_request(self, request_id: str, learn: bool = True, token_ids: Sequence[int] | None = None) -> None: ...
