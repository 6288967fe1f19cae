"""Train the bundled tiny reasoning model from scratch: ``python -m reasoning_engine.tiny.train``.

Everything derives from fixed seeds: the synthetic corpus, the tokenizer's merges, the initial weights and the
batch order, so a rerun on the same software reproduces the shipped assets (bit-exactness across machines is not
promised: CPU kernels may sum in different orders). Layer 0 starts with a hand-set previous-token head
(model.install_previous_token_head). The loss is next-token cross-entropy on the assistant turn being
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
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import multiprocessing  # noqa: E402
import time  # noqa: E402
from concurrent.futures import Future, ProcessPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from reasoning_engine.tiny import BUNDLED_MODEL_DIR  # noqa: E402
from reasoning_engine.tiny.chat_format import IM_END, PAD  # noqa: E402
from reasoning_engine.tiny.data import TRAIN_SEED, training_sample  # noqa: E402
from reasoning_engine.tiny.model import (  # noqa: E402
    TinyConfig,
    TinyDeepseekV3,
    install_previous_token_head,
    save_checkpoint,
)
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
    max_minutes: float = 60.0
    device: str = "cpu"
    data_workers: int = 0


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> TinyConfig:
    """The shipped architecture: 4 layers (1 dense + 3 MoE) + 1 MTP layer, 8 routed experts (top-2 of 4 groups)."""
    return TinyConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, moe_intermediate_size=64,
        num_hidden_layers=4, num_nextn_predict_layers=1, num_attention_heads=8,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_theta=10000.0,
        max_position_embeddings=MAX_MODEL_LEN,
        eos_token_id=eos_id, pad_token_id=pad_id,
    )


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def pool_batches(seed: int, index: int, size: int, tokens_per_batch: int, tokenizer: Tokenizer) -> list[Batch]:
    """The `index`-th pool of `size` fresh samples, tokenized and cut into length-bucketed, right-padded batches of
    (input_ids, valid-token mask, loss mask on completion tokens). Each pool has its own seed, so the data stream is
    the same whether pools are made in this process or by workers."""
    rng = random.Random(seed * 1_000_003 + index)
    samples = [training_sample(rng) for _ in range(size)]
    # A prompt ends at an added token (<think> or </think>), so encoding the two parts separately equals encoding
    # their concatenation.
    prompts = tokenizer.encode_batch([s.prompt() for s in samples])
    completions = tokenizer.encode_batch([s.completion() for s in samples])
    pool = [(p.ids + c.ids, len(p.ids)) for p, c in zip(prompts, completions)]
    pad_id = tokenizer.token_to_id(PAD)
    order = sorted(range(len(pool)), key=lambda i: len(pool[i][0]))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and len(pool[i][0]) * (len(current) + 1) > tokens_per_batch:
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


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOKENIZER
    torch.set_num_threads(1)
    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _worker_pool(seed: int, index: int, size: int, tokens_per_batch: int) -> list[Batch]:
    assert _WORKER_TOKENIZER is not None
    return pool_batches(seed, index, size, tokens_per_batch, _WORKER_TOKENIZER)


class BatchStream:
    """Batches pool after pool; with workers, the next pools are generated in other processes while training runs
    (on a GPU the Python data generator, not the model, would otherwise set the pace)."""

    def __init__(self, tokenizer: Tokenizer, args: TrainArgs, first_pool: int = 0) -> None:
        self.tokenizer, self.args, self.next_pool = tokenizer, args, first_pool
        self.queue: list[Batch] = []
        self.executor = None
        self.pending: list[Future] = []
        if args.data_workers > 0:
            self.executor = ProcessPoolExecutor(args.data_workers, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_init_worker, initargs=(tokenizer.to_str(),))
            for _ in range(2 * args.data_workers):
                self._submit()

    def _submit(self) -> None:
        a = self.args
        self.pending.append(self.executor.submit(_worker_pool, a.seed, self.next_pool, a.pool_size, a.tokens_per_batch))
        self.next_pool += 1

    def next(self) -> Batch:
        while not self.queue:
            if self.executor is None:
                a = self.args
                self.queue = pool_batches(a.seed, self.next_pool, a.pool_size, a.tokens_per_batch, self.tokenizer)
                self.next_pool += 1
            else:
                self.queue = self.pending.pop(0).result()
                self._submit()
        return self.queue.pop()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)


def losses(model: TinyDeepseekV3, ids: torch.Tensor, valid: torch.Tensor,
           target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token loss and mean MTP (t+2) loss over the completion tokens."""
    logits, mtp_logits = model(ids, token_mask=valid, with_mtp=True)
    v = logits.shape[-1]
    main_mask = target[:, 1:]
    main = F.cross_entropy(logits[:, :-1][main_mask].view(-1, v).float(), ids[:, 1:][main_mask])
    mtp_mask = target[:, 2:]
    mtp = F.cross_entropy(mtp_logits[:, :-1][mtp_mask].view(-1, v).float(), ids[:, 2:][mtp_mask])
    return main, mtp


@torch.no_grad()
def update_routing_bias(model: TinyDeepseekV3, speed: float) -> torch.Tensor:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones; returns the worst
    max/mean load ratio over the MoE layers (a tensor, so a GPU run does not wait for it every step)."""
    worst = torch.zeros(())
    for moe in model.moe_layers():
        counts = moe.last_counts
        mean = counts.mean()
        moe.gate.e_score_correction_bias += speed * torch.sign(mean - counts)
        worst = torch.maximum(worst.to(counts.device), counts.max() / mean.clamp(min=1))
    return worst


def progress(step: int, elapsed_s: float, args: TrainArgs) -> float:
    """Fraction of the run done: by steps, or by wall time when the time limit comes first, so the schedule always
    finishes its decay within max_minutes."""
    return max(step / args.steps, elapsed_s / (60 * args.max_minutes))


def lr_at(step: int, done: float, args: TrainArgs) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def write_generation_config(out_dir: Path, eos_id: int, pad_id: int) -> None:
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False, "max_new_tokens": 512},
                  f, indent=2)
        f.write("\n")


def save_model(model: TinyDeepseekV3, tokenizer: Tokenizer, out_dir: Path, eos_id: int, pad_id: int) -> None:
    save_tokenizer(tokenizer, out_dir, MAX_MODEL_LEN)
    save_checkpoint(model, out_dir)
    write_generation_config(out_dir, eos_id, pad_id)


def save_state(path: Path, model: TinyDeepseekV3, opt: torch.optim.Optimizer, step: int, tokens_seen: int,
               next_pool: int, queue: list[Batch], elapsed_s: float) -> None:
    """Everything needed to continue the run: weights, routing biases, optimizer, position in the data stream."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens_seen": tokens_seen,
                "next_pool": next_pool, "queue": queue, "elapsed_s": elapsed_s}, tmp)
    tmp.replace(path)


def keeps_thread_count(train_fn):  # type: ignore[no-untyped-def]
    """Let a training function set torch's thread count for its run and give the caller's back afterwards: called
    from a longer-lived process (a test session), a changed count oversubscribes every later step."""

    @functools.wraps(train_fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        before = torch.get_num_threads()
        try:
            return train_fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper


@keeps_thread_count
def train(args: TrainArgs, resume: bool = False) -> None:
    """Build the tokenizer, train, and write the checkpoint; with resume, continue from checkpoint_dir/state.pt."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    start = time.time()
    print(f"building tokenizer -> {args.out_dir}", flush=True)
    tokenizer = build_tokenizer(corpus_for_vocab(20000, args.seed + 1))
    save_tokenizer(tokenizer, args.out_dir, MAX_MODEL_LEN)
    eos_id, pad_id = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(PAD)
    cfg = model_config(tokenizer.get_vocab_size(), eos_id, pad_id)
    model = TinyDeepseekV3(cfg)
    on_prev = install_previous_token_head(model, torch.Generator().manual_seed(args.seed))
    print(f"layer 0 head 0 starts as a previous-token head ({on_prev:.0%} of its attention)", flush=True)
    model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"vocab {cfg.vocab_size}, parameters {params:,} (+{2 * cfg.vocab_size * cfg.hidden_size:,} MTP copies "
          f"in the checkpoint), device {device}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    first_step, tokens_seen, first_pool, queue, spent = 0, 0, 0, [], 0.0
    state_path = args.checkpoint_dir / "state.pt"
    if resume:
        state = torch.load(state_path, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first_step, tokens_seen, first_pool = state["step"], state["tokens_seen"], state["next_pool"]
        queue, spent = state["queue"], state["elapsed_s"]
        print(f"resuming at step {first_step}", flush=True)
    stream = BatchStream(tokenizer, args, first_pool)
    stream.queue = queue
    # bf16 autocast on CUDA; CPU trains in float32 (autocast there is slower than plain float32 on small matrices).
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    args.log_file.parent.mkdir(parents=True, exist_ok=True)
    train_start = time.time() - spent
    step = first_step
    with open(args.log_file, "a" if resume else "w", newline="") as log_f:
        log = csv.writer(log_f)
        if not resume:
            log.writerow(["step", "loss", "mtp_loss", "lr", "tokens", "elapsed_s", "max_expert_load"])
        bar = tqdm(total=args.steps, initial=first_step, desc="train", dynamic_ncols=True, mininterval=2.0)
        while True:
            done = progress(step, time.time() - train_start, args)
            if done >= 1.0:
                break
            ids, valid, target = (t.to(device, non_blocking=True) for t in stream.next())
            lr = lr_at(step, done, args)
            for group in opt.param_groups:
                group["lr"] = lr
            with autocast:
                main, mtp = losses(model, ids, valid, target)
            loss = main + MTP_WEIGHT * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            load = update_routing_bias(model, BIAS_UPDATE_SPEED * lr_at(max(step, args.warmup), done, args) / args.lr)
            tokens_seen += int(valid.sum())
            step += 1
            bar.update(1)
            if step % 25 == 0 or step == first_step + 1:
                main_v, mtp_v, load_v = main.item(), mtp.item(), load.item()
                bar.set_postfix(loss=f"{main_v:.3f}", mtp=f"{mtp_v:.3f}", load=f"{load_v:.2f}")
                log.writerow([step, f"{main_v:.4f}", f"{mtp_v:.4f}", f"{lr:.2e}", tokens_seen,
                              f"{time.time() - start:.0f}", f"{load_v:.2f}"])
                log_f.flush()
            if args.save_every and step % args.save_every == 0:
                save_model(model, tokenizer, args.checkpoint_dir, eos_id, pad_id)
                save_state(state_path, model, opt, step, tokens_seen, stream.next_pool, stream.queue,
                           time.time() - train_start)
        bar.close()
    stream.close()
    model.eval()
    save_model(model.cpu(), tokenizer, args.out_dir, eos_id, pad_id)
    print(f"done in {(time.time() - start) / 60:.1f} min, {step} steps, {tokens_seen:,} tokens; saved to "
          f"{args.out_dir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 4500; --quick: 20)")
    parser.add_argument("--max-minutes", type=float, default=60.0,
                        help="wall-time limit; the learning-rate schedule ends by then even if steps remain")
    parser.add_argument("--quick", action="store_true", help="smoke test: few steps, writes to artifacts/tiny/quick")
    parser.add_argument("--tokens-per-batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--pool-size", type=int, default=2048, help="samples generated at once (then bucketed)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    parser.add_argument("--data-workers", type=int, default=0, help="processes generating data ahead (0: inline)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=TRAIN_SEED)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the bundled assets directory")
    parser.add_argument("--log-file", type=Path, default=Path("artifacts/tiny/train_log.csv"))
    parser.add_argument("--save-every", type=int, default=0, help="also save an intermediate checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("artifacts/tiny/checkpoint"))
    parser.add_argument("--resume", action="store_true", help="continue from the last --save-every state")
    ns = parser.parse_args(argv)
    steps = ns.steps if ns.steps is not None else (20 if ns.quick else 4500)
    out_dir = ns.out_dir or (Path("artifacts/tiny/quick") if ns.quick else BUNDLED_MODEL_DIR)
    device = ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    train(TrainArgs(steps=steps, tokens_per_batch=ns.tokens_per_batch, lr=ns.lr, warmup=min(ns.warmup, steps // 10 + 1),
                    weight_decay=0.05, pool_size=256 if ns.quick else ns.pool_size, seed=ns.seed, threads=ns.threads,
                    out_dir=out_dir, log_file=ns.log_file, save_every=ns.save_every,
                    checkpoint_dir=ns.checkpoint_dir, max_minutes=ns.max_minutes, device=device,
                    data_workers=ns.data_workers), resume=ns.resume)


if __name__ == "__main__":
    main()
