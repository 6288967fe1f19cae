"""One request's position in its grammar, and the packed token bitmasks the sampler turns into masks.

A bitmask row is int32 [ceil(vocab / 32)], bit j of word i set when token 32 * i + j is allowed (xgrammar's layout).
The engine fills one row per constrained sampling row on the CPU, moves the packed rows to the logits' device once per
step and unpacks them there (`unpack_bitmask`): 32x less to copy than a bool mask.
"""

from __future__ import annotations

from typing import Any

import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Rows with every token allowed (-1 = all bits set): rows left unfilled do not constrain."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class StructuredMatcher:
    """Wraps an xgrammar GrammarMatcher. Every token the request emits after its constraint starts goes through
    `accept`; speculative verification explores draft paths with `accept` and `rollback`."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0  # tokens consumed so far (a preempted request's recompute must not add to it)

    @classmethod
    def start(cls, compiled: Any, vocab_size: int) -> StructuredMatcher:
        import xgrammar

        return cls(xgrammar.GrammarMatcher(compiled), vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed CPU bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens allowed next (tests, debugging)."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return unpack_bitmask(bitmask, self.vocab_size)[0]

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (and no change) when the grammar does not allow it."""
        if not 0 <= token < self.vocab_size or not self._matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    def accept_prefix(self, tokens: list[int]) -> int:
        """Advance over the longest allowed prefix of `tokens`; returns its length."""
        for i, token in enumerate(tokens):
            if not self.accept(token):
                return i
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def walk_draft(self, token_ids: list[int], parents: list[int], thinking: bool, think_end: int | None,
                   bitmask: torch.Tensor | None = None) -> list[bool]:
        """Which nodes of a draft tree (`parents[i] < i`, -1 = the root) the grammar allows on their path. Tokens up
        to and including a drafted `think_end` are free while `thinking`. With `bitmask` (1 + len rows), row 0 gets
        the mask at the root and row i + 1 the mask after node i, for allowed nodes outside thinking; other rows
        are left as they are. Depth-first with accept / rollback: the matcher ends where it began."""
        allowed = [False] * len(token_ids)
        children: list[list[int]] = [[] for _ in range(len(token_ids) + 1)]
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)

        def visit(node: int, free: bool) -> None:
            if bitmask is not None and not free and not self.is_terminated:
                self.fill_bitmask(bitmask, node + 1)
            for child in children[node + 1]:
                token = token_ids[child]
                if free:
                    allowed[child] = True
                    visit(child, token != think_end)
                elif self.accept(token):
                    allowed[child] = True
                    visit(child, False)
                    self.rollback(1)

        visit(-1, thinking)
        return allowed

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()

    def fork(self) -> StructuredMatcher:
        """An independent copy at the same position (n > 1 samples share the prompt, not the future)."""
        copy = StructuredMatcher(self._matcher.fork(), self.vocab_size)
        copy.num_accepted = self.num_accepted
        return copy
