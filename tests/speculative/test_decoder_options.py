"""speculative_config options: vLLM's n-gram names are accepted, an unknown option is a ValueError naming it."""

from __future__ import annotations

import pytest

from reasoning_engine.speculative.decoder import SpeculativeConfig, make_proposer


def test_ngram_takes_vllms_option_names() -> None:
    proposer = make_proposer(SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}))
    assert list(proposer.contexts.orders) == [2, 3, 4, 5]


@pytest.mark.parametrize("method", ["ngram", "suffix", "lookup"])
def test_unknown_option_is_a_value_error_naming_it(method: str) -> None:
    with pytest.raises(ValueError, match="'bogus' is not an option of the"):
        make_proposer(SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 3, "bogus": 1}))
