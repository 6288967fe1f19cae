"""Compiling a request's `StructuredOutputsParams` against the model's vocabulary, with a bounded LRU cache.

xgrammar (chosen by benchmarks/grammar_backends.py, see docs/ARCHITECTURE.md) precomputes, per grammar, which tokens
each grammar position accepts regardless of context; that makes per-step masks a few microseconds but a compile up to
tens of milliseconds on a 150k vocabulary, paid once per distinct spec thanks to the cache. Agents resend the same
schema with every call, so the hit rate is high. The cache is shared by the engine thread and the AsyncLLM client
side (which validates before queueing), hence the lock; compiling itself happens outside it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from reasoning_engine.structured.matcher import StructuredMatcher
from reasoning_engine.structured.params import JSON_SEPARATORS, StructuredOutputsParams, short_error


class GrammarCompiler:
    """Compiles specs for one tokenizer. `vocab_size` is the model's logits width (may exceed the tokenizer's
    length: padding rows are never allowed); `stop_token_ids` end a complete output (the engine's EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_cached: int = 256,
                 threads: int = 1) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar (an xgrammar CompiledGrammar); ValueError naming the field if it cannot compile."""
        key = spec.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> StructuredMatcher:
        """A fresh per-request matcher at the start of the grammar."""
        return StructuredMatcher.start(self.compile(spec), self.vocab_size)

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        kind = spec.kind
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(json.dumps(spec.enforced_schema()), any_whitespace=False,
                                             separators=JSON_SEPARATORS)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS,
                                             strict_mode=False)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "structural_tag":
                return c.compile_structural_tag(spec.structural_tag_json())
            return c.compile_grammar(spec.ebnf() if kind == "choice" else spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {short_error(e)}") from None
