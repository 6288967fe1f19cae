"""Train the bundled tiny reasoning model from scratch: ``python -m reasoning_engine.tiny.train``.

Everything derives from fixed seeds: the synthetic corpus, the tokenizer's merges, the initial weights and the
batch order, so a rerun on the same software reproduces the shipped assets (bit-exactness across machines is not
promised: CPU kernels may sum in different orders). The loss is next-token cross-entropy on the assistant turn being
trained plus 0.3 x the MTP loss (token t+2 from h_t and token t+1, DeepSeek-V3 sec. 2.2). MoE load is balanced without
an auxiliary loss: after every step each expert's selection bias moves by +-gamma towards the mean load (DeepSeek-V3,
arXiv:2412.19437, sec. 2.1.2).
"""

from __future__ import annotations

import os

# On a shared CPU, OpenMP workers that spin while another process holds a core slow training down ~10x; passive
# waiting costs ~20% on an idle machine. It only takes effect if set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from reasoning_engine.tiny import BUNDLED_MODEL_DIR  # noqa: E402
from reasoning_engine.tiny.chat_format import IM_END, PAD  # noqa: E402
from reasoning_engine.tiny.data import TRAIN_SEED, training_sample  # noqa: E402
from reasoning_engine.tiny.model import TinyConfig, TinyDeepseekV3, save_checkpoint  # noqa: E402
from reasoning_engine.tiny.tokenizer import build_tokenizer, corpus_for_vocab, save_tokenizer  # noqa: E402

MAX_MODEL_LEN = 2048
MTP_WEIGHT = 0.3
# DeepSeek-V3 uses gamma = 0.001 over trillions of tokens; a run of a few thousand steps needs a faster start, so gamma
# follows the learning-rate schedule from 0.01 down.
BIAS_UPDATE_SPEED = 1e-2


@dataclass
class TrainArgs:
    steps: int
    tokens_per_batch: int
    lr: float
    warmup: int
    weight_decay: float
    pool_size: int
    seed: int
    threads: int
    out_dir: Path
    log_file: Path
    save_every: int
    checkpoint_dir: Path


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> TinyConfig:
    """The shipped architecture: 4 layers (1 dense + 3 MoE) + 1 MTP layer, 8 routed experts (top-2 of 4 groups)."""
    return TinyConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, moe_intermediate_size=64,
        num_hidden_layers=4, num_nextn_predict_layers=1, num_attention_heads=8,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, rope_theta=1000.0,
        max_position_embeddings=MAX_MODEL_LEN,
        eos_token_id=eos_id, pad_token_id=pad_id,
    )


def tokenized_pool(rng: random.Random, tokenizer, size: int) -> list[tuple[list[int], int]]:
    """`size` fresh samples as (prompt + completion ids, prompt length); the prompt ends at an added token
    (``<think>`` or ``</think>``), so encoding the two parts separately equals encoding their concatenation."""
    samples = [training_sample(rng) for _ in range(size)]
    prompts = tokenizer.encode_batch([s.prompt() for s in samples])
    completions = tokenizer.encode_batch([s.completion() for s in samples])
    return [(p.ids + c.ids, len(p.ids)) for p, c in zip(prompts, completions)]


def batches_from_pool(pool: list[tuple[list[int], int]], tokens_per_batch: int, pad_id: int,
                      rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Length-bucketed, right-padded batches: (input_ids, valid-token mask, loss mask on completion tokens)."""
    order = sorted(range(len(pool)), key=lambda i: len(pool[i][0]))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        length = len(pool[i][0])
        if current and length * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    out = []
    for group in groups:
        width = max(len(pool[i][0]) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        target = torch.zeros(len(group), width, dtype=torch.bool)
        for row, i in enumerate(group):
            seq, plen = pool[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            valid[row, : len(seq)] = True
            target[row, plen: len(seq)] = True
        out.append((ids, valid, target))
    return out


def losses(model: TinyDeepseekV3, ids: torch.Tensor, valid: torch.Tensor,
           target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token loss and mean MTP (t+2) loss over the completion tokens."""
    logits, mtp_logits = model(ids, token_mask=valid, with_mtp=True)
    v = logits.shape[-1]
    main_mask = target[:, 1:]
    main = F.cross_entropy(logits[:, :-1][main_mask].view(-1, v), ids[:, 1:][main_mask])
    mtp_mask = target[:, 2:]
    mtp = F.cross_entropy(mtp_logits[:, :-1][mtp_mask].view(-1, v), ids[:, 2:][mtp_mask])
    return main, mtp


@torch.no_grad()
def update_routing_bias(model: TinyDeepseekV3, speed: float) -> float:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones; returns the worst
    max/mean load ratio over the MoE layers for the log."""
    worst = 0.0
    for moe in model.moe_layers():
        counts = moe.last_counts
        mean = counts.mean()
        moe.gate.e_score_correction_bias += speed * torch.sign(mean - counts)
        worst = max(worst, (counts.max() / mean.clamp(min=1)).item())
    return worst


def lr_at(step: int, args: TrainArgs) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def write_generation_config(out_dir: Path, eos_id: int, pad_id: int) -> None:
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False, "max_new_tokens": 512},
                  f, indent=2)
        f.write("\n")


def save_state(path: Path, model: TinyDeepseekV3, opt: torch.optim.Optimizer, step: int, tokens_seen: int,
               data_rng: random.Random, queue: list) -> None:
    """Everything needed to continue the run bit-for-bit: weights, routing biases, optimizer, data stream."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens_seen": tokens_seen,
                "rng": data_rng.getstate(), "queue": queue}, tmp)
    tmp.replace(path)


def train(args: TrainArgs, resume: bool = False) -> None:
    """Build the tokenizer, train, and write the checkpoint; with resume, continue from checkpoint_dir/state.pt."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    print(f"building tokenizer -> {args.out_dir}", flush=True)
    tokenizer = build_tokenizer(corpus_for_vocab(20000, args.seed + 1))
    save_tokenizer(tokenizer, args.out_dir, MAX_MODEL_LEN)
    eos_id, pad_id = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(PAD)
    cfg = model_config(tokenizer.get_vocab_size(), eos_id, pad_id)
    model = TinyDeepseekV3(cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"vocab {cfg.vocab_size}, parameters {params:,} (+{2 * cfg.vocab_size * cfg.hidden_size:,} MTP copies "
          f"in the checkpoint)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    data_rng = random.Random(args.seed)
    queue: list = []
    first_step, tokens_seen = 0, 0
    state_path = args.checkpoint_dir / "state.pt"
    if resume:
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        data_rng.setstate(state["rng"])
        queue, first_step, tokens_seen = state["queue"], state["step"], state["tokens_seen"]
        print(f"resuming at step {first_step}", flush=True)
    args.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(args.log_file, "a" if resume else "w", newline="") as log_f:
        log = csv.writer(log_f)
        if not resume:
            log.writerow(["step", "loss", "mtp_loss", "lr", "tokens", "elapsed_s", "max_expert_load"])
        bar = tqdm(range(first_step, args.steps), desc="train", dynamic_ncols=True, initial=first_step,
                   total=args.steps)
        for step in bar:
            if not queue:
                queue = batches_from_pool(tokenized_pool(data_rng, tokenizer, args.pool_size),
                                          args.tokens_per_batch, pad_id, data_rng)
            ids, valid, target = queue.pop()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            main, mtp = losses(model, ids, valid, target)
            loss = main + MTP_WEIGHT * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            load = update_routing_bias(model, BIAS_UPDATE_SPEED * lr_at(max(step, args.warmup), args) / args.lr)
            tokens_seen += int(valid.sum())
            bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{mtp.item():.3f}", load=f"{load:.2f}")
            log.writerow([step, f"{main.item():.4f}", f"{mtp.item():.4f}", f"{lr_at(step, args):.2e}", tokens_seen,
                          f"{time.time() - start:.0f}", f"{load:.2f}"])
            if step % 25 == 0:
                log_f.flush()
            if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                save_tokenizer(tokenizer, args.checkpoint_dir, MAX_MODEL_LEN)
                save_checkpoint(model, args.checkpoint_dir)
                write_generation_config(args.checkpoint_dir, eos_id, pad_id)
                save_state(state_path, model, opt, step + 1, tokens_seen, data_rng, queue)
    model.eval()
    save_checkpoint(model, args.out_dir)
    write_generation_config(args.out_dir, eos_id, pad_id)
    print(f"done in {(time.time() - start) / 60:.1f} min, {tokens_seen:,} tokens; saved to {args.out_dir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 5000; --quick: 20)")
    parser.add_argument("--quick", action="store_true", help="smoke test: few steps, writes to artifacts/tiny/quick")
    parser.add_argument("--tokens-per-batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=TRAIN_SEED)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the bundled assets directory")
    parser.add_argument("--log-file", type=Path, default=Path("artifacts/tiny/train_log.csv"))
    parser.add_argument("--save-every", type=int, default=0, help="also save an intermediate checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("artifacts/tiny/checkpoint"))
    parser.add_argument("--resume", action="store_true", help="continue from the last --save-every state")
    ns = parser.parse_args(argv)
    steps = ns.steps if ns.steps is not None else (20 if ns.quick else 5000)
    out_dir = ns.out_dir or (Path("artifacts/tiny/quick") if ns.quick else BUNDLED_MODEL_DIR)
    train(TrainArgs(steps=steps, tokens_per_batch=ns.tokens_per_batch, lr=ns.lr, warmup=min(100, steps // 10 + 1),
                    weight_decay=0.05, pool_size=256 if ns.quick else 2048, seed=ns.seed, threads=ns.threads,
                    out_dir=out_dir, log_file=ns.log_file, save_every=ns.save_every,
                    checkpoint_dir=ns.checkpoint_dir), resume=ns.resume)


if __name__ == "__main__":
    main()
