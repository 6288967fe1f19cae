"""Speculative decoding: draft proposers and their offline replay.

`build_proposer(speculative_config)` turns a vLLM-shaped config ({"method": ..., "num_speculative_tokens": K, ...}) into
a proposer implementing `Proposer` (draft.py); the engine verifies the returned `Draft` trees.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from reasoning_engine.speculative.draft import Draft, Proposer
from reasoning_engine.speculative.lookup import LookupProposer
from reasoning_engine.speculative.ngram import NgramProposer
from reasoning_engine.speculative.suffix_tree import SuffixConfig, SuffixProposer

METHODS = ("ngram", "lookup", "suffix")

# vLLM's names for the n-gram bounds, accepted so its configs work unchanged.
_ALIASES = {"prompt_lookup_max": "max_n", "prompt_lookup_min": "min_n"}


def build_proposer(config: Mapping[str, Any], state_dir: str | os.PathLike[str] | None = None) -> Proposer:
    """Make the proposer a speculative_config names; `state_dir` (suffix only) is loaded when it holds saved state.

    Keys besides method and num_speculative_tokens are the proposer's own options (e.g. min_token_prob, tree).
    """
    options = {_ALIASES.get(k, k): v for k, v in config.items() if k not in ("method", "num_speculative_tokens")}
    method = config.get("method")
    if method == "ngram":
        return NgramProposer(**options)
    if method == "lookup":
        return LookupProposer(**options)
    if method == "suffix":
        if "orders" in options:
            options["orders"] = tuple(options["orders"])
        proposer = SuffixProposer(SuffixConfig(**options))
        if state_dir is not None and os.path.exists(os.path.join(state_dir, "suffix_state.json")):
            proposer.load(state_dir)
        return proposer
    raise ValueError(f"speculative method must be one of {METHODS}, got {method!r}")


__all__ = ["METHODS", "Draft", "LookupProposer", "NgramProposer", "Proposer", "SuffixConfig", "SuffixProposer",
           "build_proposer"]
