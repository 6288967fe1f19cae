"""llguidance vs xgrammar on CPU: the measurement behind reasoning_engine/structured's choice of library.

For each tokenizer (the bundled model's, 921 tokens, and a byte-level BPE trained here to ~150k tokens, the size of
Kimi's and DeepSeek's vocabularies) and each of N generated schemas (schema_gen.py): the time to compile the schema
into something that can produce masks (llguidance: the matcher; xgrammar: the compiled grammar, whose token tables
are built at compile time), the time to the first mask, and the mean time per token mask while walking a valid
instance of the schema token by token. Whitespace is compact in both (separators "," and ":").

    python benchmarks/grammar_backends.py [--schemas 20] [--big-vocab 150000] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from schema_gen import generate_schemas

REPO = Path(__file__).resolve().parent.parent


def bundled_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(REPO / "reasoning_engine" / "tiny" / "assets"))


def big_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on a synthetic corpus (random syllable words) until it has `vocab_size` tokens:
    offline, and as large as a production vocabulary, which is what mask time scales with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou") + ["th", "ch", "sh", "ng"]
    lines = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 6))) for _ in range(20))
             for _ in range(60000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|eos|>"])
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lib, self.torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.vocab = len(tokenizer)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.lib.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        matcher = self.lib.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def bitmask(self) -> torch.Tensor:
        return self.torch.allocate_token_bitmask(1, self.vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab = len(tokenizer)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return self.lib.GrammarMatcher(compiled)

    def bitmask(self) -> torch.Tensor:
        return self.lib.allocate_token_bitmask(1, self.vocab)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)


def measure(backend: Any, tokenizer: Any, cases: list[tuple[dict[str, Any], Any]]) -> dict[str, float]:
    compile_ms, first_ms, mask_us = [], [], []
    for schema, instance in cases:
        tokens = tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        t0 = time.perf_counter()
        matcher = backend.compile(schema)
        t1 = time.perf_counter()
        bitmask = backend.bitmask()
        backend.fill(matcher, bitmask)
        first_ms.append((time.perf_counter() - t1) * 1e3)
        compile_ms.append((t1 - t0) * 1e3)
        for token in tokens:
            backend.accept(matcher, token)
            t2 = time.perf_counter()
            backend.fill(matcher, bitmask)
            mask_us.append((time.perf_counter() - t2) * 1e6)
    return {"compile_ms_median": statistics.median(compile_ms), "compile_ms_max": max(compile_ms),
            "first_mask_ms_median": statistics.median(first_ms),
            "mask_us_mean": statistics.fmean(mask_us), "mask_us_p99": sorted(mask_us)[int(0.99 * (len(mask_us) - 1))],
            "masks": len(mask_us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--big-vocab", type=int, default=150000)
    parser.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the figures")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = generate_schemas(args.schemas, seed=1)
    rows = []
    for label, make in (("bundled (921)", bundled_tokenizer), (f"byte-level BPE ({args.big_vocab})",
                                                               lambda: big_tokenizer(args.big_vocab))):
        t0 = time.perf_counter()
        tokenizer = make()
        for backend_cls in (Llguidance, Xgrammar):
            t1 = time.perf_counter()
            backend = backend_cls(tokenizer) if backend_cls is Llguidance else backend_cls(tokenizer, args.threads)
            setup_ms = (time.perf_counter() - t1) * 1e3
            figures = measure(backend, tokenizer, cases)
            rows.append({"tokenizer": label, "vocab": len(tokenizer), "backend": backend.name,
                         "tokenizer_setup_ms": setup_ms, **figures})
            print(json.dumps(rows[-1]), flush=True)
        print(f"({label}: built in {time.perf_counter() - t0:.1f} s)", flush=True)
    print("\n| tokenizer | backend | setup ms | compile ms (median / max) | first mask ms | mask us (mean / p99) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['backend']} | {r['tokenizer_setup_ms']:.0f} | {r['compile_ms_median']:.2f} / "
              f"{r['compile_ms_max']:.2f} | {r['first_mask_ms_median']:.2f} | {r['mask_us_mean']:.0f} / "
              f"{r['mask_us_p99']:.0f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
