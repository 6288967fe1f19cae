"""Speculative decoding: draft proposers and their offline replay.

`build_proposer(speculative_config)` turns a vLLM-shaped config ({"method": ..., "num_speculative_tokens": K, ...}) into
a proposer implementing `Proposer` (draft.py); the engine verifies the returned `Draft` trees.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from reasoning_engine.speculative.decoder import TEXT_METHODS, text_proposer
from reasoning_engine.speculative.draft import Draft, Proposer
from reasoning_engine.speculative.lookup import LookupProposer
from reasoning_engine.speculative.ngram import NgramProposer
from reasoning_engine.speculative.suffix_tree import SuffixConfig, SuffixProposer

METHODS = TEXT_METHODS


def build_proposer(config: Mapping[str, Any], state_dir: str | os.PathLike[str] | None = None) -> Proposer:
    """Make the text proposer a speculative_config names, as the engine does (`decoder.text_proposer`): vLLM's n-gram
    option names are accepted, an unknown option is a ValueError naming it, and the suffix proposer starts from the
    store saved in `state_dir`, if any. Keys besides method and num_speculative_tokens are the proposer's own options
    (e.g. min_token_prob, tree)."""
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative method must be one of {METHODS}, got {method!r}")
    options = {k: v for k, v in config.items() if k not in ("method", "num_speculative_tokens")}
    return text_proposer(method, options, None if state_dir is None else os.fspath(state_dir))


__all__ = ["METHODS", "Draft", "LookupProposer", "NgramProposer", "Proposer", "SuffixConfig", "SuffixProposer",
           "build_proposer"]
