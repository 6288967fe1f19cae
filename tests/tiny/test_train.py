"""The training script: batches are deterministic and mask the right tokens; layer 0 starts with a previous-token
head; a few steps write a loadable checkpoint."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from reasoning_engine.tiny import BUNDLED_MODEL_DIR
from reasoning_engine.tiny.chat_format import PAD, THINK_BEGIN, THINK_END
import random

from reasoning_engine.tiny.data import training_sample
from reasoning_engine.tiny.model import TinyDeepseekV3, install_previous_token_head, load_checkpoint, rope_cos_sin
from reasoning_engine.tiny.train import TrainArgs, model_config, pool_batches, train


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))


def test_pool_batches_are_deterministic_and_mask_completions() -> None:
    tok = _tokenizer()
    first = pool_batches(7, 3, 64, 1024, tok)
    again = pool_batches(7, 3, 64, 1024, tok)
    other = pool_batches(7, 4, 64, 1024, tok)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(a[0].shape == b[0].shape and torch.equal(a[0], b[0]) for a, b in zip(first, other))
    assert sum(ids.shape[0] for ids, _, _ in first) == 64
    think, pad = tok.token_to_id(THINK_BEGIN), tok.token_to_id(PAD)
    for ids, valid, target in first:
        assert ids.numel() <= 1024 or ids.shape[0] == 1
        assert torch.equal(ids == pad, ~valid)
        assert not (target & ~valid).any()
        for row in range(ids.shape[0]):
            start = int(target[row].float().argmax())
            # The loss starts right after the prompt, which ends with the <think> of the generation prompt (or its
            # closing tag when thinking is off), and covers every remaining real token.
            assert int(ids[row, start - 1]) in (think, tok.token_to_id(THINK_END))
            assert bool(target[row, start:int(valid[row].sum())].all())


def _layer0_attention(model: TinyDeepseekV3, ids: torch.Tensor) -> torch.Tensor:
    layer = model.model.layers[0]
    cos, sin = rope_cos_sin(model.cfg, torch.arange(ids.shape[1]))
    with torch.no_grad():
        return layer.self_attn.attention_weights(layer.input_layernorm(model.model.embed_tokens(ids)), cos, sin)[0]


def test_layer0_head0_starts_on_the_previous_token() -> None:
    tok = _tokenizer()
    sample = training_sample(random.Random(3))
    ids = torch.tensor([tok.encode(sample.prompt() + sample.completion()).ids])
    torch.manual_seed(0)
    model = TinyDeepseekV3(model_config(tok.get_vocab_size(), 1, 0))
    before = _layer0_attention(model, ids).diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)
    reported = install_previous_token_head(model, torch.Generator().manual_seed(1))
    on_prev = _layer0_attention(model, ids).diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)
    assert reported > 0.85
    assert float(on_prev[0]) > 0.85, on_prev
    # Random heads spread their attention; the other heads stay so.
    assert float(before.max()) < 0.5 and float(on_prev[1:].max()) < 0.5, (before, on_prev)
    logits, mtp = model(ids, with_mtp=True)
    assert torch.isfinite(logits).all() and torch.isfinite(mtp).all()


@pytest.mark.slow
def test_a_few_steps_write_a_loadable_checkpoint(tmp_path: Path) -> None:
    """...and leave the caller's torch thread count as it was (the run sets its own): a test session that trained
    ran every later test oversubscribed."""
    before = torch.get_num_threads()
    args = TrainArgs(steps=3, tokens_per_batch=512, lr=1e-3, warmup=1, weight_decay=0.05, pool_size=32, seed=1,
                     threads=before + 1, out_dir=tmp_path / "model", log_file=tmp_path / "log.csv", save_every=0,
                     checkpoint_dir=tmp_path / "ckpt", max_minutes=5.0, device="cpu")
    train(args)
    assert torch.get_num_threads() == before
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tmp_path / "model" / name).is_file()
    model = load_checkpoint(tmp_path / "model")
    logits, _ = model(torch.tensor([[3, 4, 5]]))
    assert torch.isfinite(logits).all()
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert rows and all(float(r["loss"]) > 0 for r in rows)
