"""Give the tiny reasoner eyes: ``python -m reasoning_engine.tiny.train_vision``.

Starts from the text-only model (``reasoning_engine.tiny.train``'s output, ``--base``), adds Kimi K2.5's media tokens to
its tokenizer (four new embedding rows), a small MoonViT-style vision tower and projector
(``reasoning_engine.models.kimi_vision.KimiVisionEncoder``, the very module the engine serves with, so training and
serving run one forward), and trains everything together on a mix of the synthetic picture questions
(``vision_data``), replayed text tasks (``data.training_sample``, so nothing is forgotten) and extra problems for the
two text gaps (doubled letters, lists with one-digit numbers). Loss: next-token cross-entropy on the assistant turn plus
0.3 x the MTP loss, as in ``train.py``, plus an auxiliary loss on the pictures: a linear probe (training only, not
shipped) reads what each image token's cell holds (empty, or which shape in which colour) from the projector's output.
Without it the first 30-minute run never learned to look: the image tokens drifted into one large constant vector
(norm ~280 against ~0.8 for a word), the language model learned the answers' templates and guessed the content. The
probe keeps every token's content readable from the start, so the language model only has to learn where to look
(deep supervision, Lee et al., 2015, "Deeply-Supervised Nets"). The routing biases keep being balanced as in
``train.py``. The language model trains at a lower learning rate than the new tower. ``--max-minutes`` (default 30)
bounds the run; the cosine schedule ends by then.

The result is a ``kimi_k25`` checkpoint with Moonshot's tensor names (``language_model.model.*``,
``vision_tower.*``, ``mm_projector.*``), a config both our engine and transformers' ``Kimi_K25Config`` read, the
processor settings (64-patch images of 8-pixel patches) and a tokenizer whose chat template renders image parts as
Kimi's placeholder. Written to a temporary folder next to ``--out-dir`` and moved into place only once written whole.
"""

from __future__ import annotations

import os

# See train.py: passive OpenMP waiting keeps a shared 2-core CPU from slowing training ~10x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import AddedToken, Tokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from reasoning_engine.models.kimi_vision import KimiVisionEncoder, VisionConfig, _checkpoint_name  # noqa: E402
from reasoning_engine.multimodal.processing import PixelSettings, patch_rows, rgb_pixels  # noqa: E402
from reasoning_engine.tiny import BUNDLED_MODEL_DIR  # noqa: E402
from reasoning_engine.tiny.chat_format import IM_END, MEDIA_BEGIN, MEDIA_END, MEDIA_PAD, MEDIA_TOKENS, PAD  # noqa: E402
from reasoning_engine.tiny.data import GENERATORS, TRAIN_MIX, Sample, decorate, training_sample  # noqa: E402
from reasoning_engine.tiny.model import TinyConfig, TinyDeepseekV3, load_checkpoint  # noqa: E402
from reasoning_engine.tiny.tokenizer import tokenizer_config  # noqa: E402
from reasoning_engine.tiny.train import (  # noqa: E402
    MAX_MODEL_LEN,
    MTP_WEIGHT,
    update_routing_bias,
    write_generation_config,
)
from reasoning_engine.tiny.vision_data import (  # noqa: E402
    IMAGE_SIZE,
    NUM_CELL_LABELS,
    VISION_TRAIN_SEED,
    cell_labels,
    training_image_sample,
)

DEFAULT_BASE = Path("artifacts/tiny/text")
# Images are 64 x 64: 8 x 8 patches of 8 pixels, merged 2 x 2 into 16 tokens. Larger pictures are scaled down to at
# most 64 patches by the processor (navit_size), so a user's picture reaches the tower at the size it was trained on.
PIXELS = PixelSettings(patch_size=8, merge_size=2, max_patches=64, max_patches_per_side=16)
VISION = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4, patch_size=8,
              pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, merge_kernel_size=[2, 2],
              hidden_act="gelu_pytorch_tanh")
# Shares of the training samples: pictures, the two text gaps, and the text replay (which holds the gaps too).
MIX = {"image": 0.45, "gap": 0.15, "text": 0.4}
GAP_TASKS = ["letters_doubled", "sorting_one_digit"]
PROBE_WEIGHT = 1.0
TEXT_MIX = {**TRAIN_MIX, "letters_doubled": 0.08, "sorting_one_digit": 0.10}


@dataclass
class VisionTrainArgs:
    base: Path
    out_dir: Path
    log_file: Path
    max_minutes: float
    steps: int
    tokens_per_batch: int
    lr: float  # the vision tower's and projector's peak
    lm_lr: float  # the language model's peak
    warmup: int
    pool_size: int
    seed: int
    threads: int


def vision_config(text_hidden: int) -> VisionConfig:
    return VisionConfig.from_config({"vision_config": VISION, "text_config": {"hidden_size": text_hidden}})


def add_media_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Kimi's media markers as special tokens after the text vocabulary; their ids."""
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MEDIA_TOKENS])
    return {t: tokenizer.token_to_id(t) for t in MEDIA_TOKENS}


def widen_vocab(model: TinyDeepseekV3, vocab_size: int) -> TinyDeepseekV3:
    """A copy of the model with `vocab_size` rows; new embedding rows start at the mean embedding plus noise, new
    output rows at the mean output row (an average logit, never the greedy pick)."""
    old = model.cfg.vocab_size
    cfg = TinyConfig(**{**model.cfg.__dict__, "vocab_size": vocab_size})
    wide = TinyDeepseekV3(cfg)
    sd = model.state_dict()
    with torch.no_grad():
        emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
        new = vocab_size - old
        sd["model.embed_tokens.weight"] = torch.cat(
            [emb, emb.mean(0) + 0.02 * torch.randn(new, emb.shape[1], generator=torch.Generator().manual_seed(0))])
        sd["lm_head.weight"] = torch.cat([head, head.mean(0).expand(new, -1)])
    wide.load_state_dict(sd)
    return wide


@dataclass
class Batch:
    """Right-padded ids, valid-token and loss masks, and the batch's images as patch rows in placeholder order with
    each image token's cell label."""

    ids: torch.Tensor
    valid: torch.Tensor
    target: torch.Tensor
    pixels: torch.Tensor | None
    grids: list[tuple[int, int, int]]
    cells: torch.Tensor | None


def sample_mix(rng: random.Random) -> Sample:
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    if kind == "image":
        return training_image_sample(rng)
    if kind == "gap":
        return decorate(GENERATORS[rng.choice(GAP_TASKS)](rng), rng)
    return training_sample(rng, TEXT_MIX)


def encode(sample: Sample, tokenizer: Tokenizer, pad_id: int) -> tuple[list[int], int, list[torch.Tensor], list[int]]:
    """(ids with each image placeholder widened to its tokens, prompt length, each image's patch rows, the image
    tokens' cell labels)."""
    images = [p["image_pil"] for m in sample.messages if isinstance(m["content"], list)
              for p in m["content"] if p.get("type") == "image_pil"]
    rows, per_image = [], []
    for image in images:
        frames = torch.from_numpy(rgb_pixels(image)).permute(2, 0, 1).unsqueeze(0)
        r, gh, gw = patch_rows(frames, PIXELS)
        rows.append(r)
        per_image.append(gh * gw // PIXELS.merge_size**2)
    # The prompt ends at an added token, so encoding prompt and completion apart equals encoding them together.
    prompt = tokenizer.encode(sample.prompt()).ids
    completion = tokenizer.encode(sample.completion()).ids
    widened: list[int] = []
    counts = iter(per_image)
    for token in prompt:
        widened.extend([token] * next(counts) if token == pad_id else [token])
    labels = cell_labels(sample.meta["objects"]) if images else []
    return widened + completion, len(widened), rows, labels


def make_pool(seed: int, index: int, size: int, tokens_per_batch: int, tokenizer: Tokenizer) -> list[Batch]:
    """The `index`-th pool of fresh samples cut into length-bucketed batches (as train.pool_batches)."""
    rng = random.Random(seed * 1_000_003 + index)
    media_pad, pad = tokenizer.token_to_id(MEDIA_PAD), tokenizer.token_to_id(PAD)
    pool = [encode(sample_mix(rng), tokenizer, media_pad) for _ in range(size)]
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
    batches = []
    for group in groups:
        width = max(len(pool[i][0]) for i in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        target = torch.zeros(len(group), width, dtype=torch.bool)
        rows: list[torch.Tensor] = []
        cells: list[int] = []
        for row, i in enumerate(group):
            seq, plen, images, labels = pool[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            valid[row, : len(seq)] = True
            target[row, plen: len(seq)] = True
            rows.extend(images)
            cells.extend(labels)
        side = IMAGE_SIZE // PIXELS.patch_size
        batches.append(Batch(ids, valid, target, torch.cat(rows) if rows else None, [(1, side, side)] * len(rows),
                             torch.tensor(cells) if rows else None))
    return batches


def forward_losses(model: TinyDeepseekV3, encoder: KimiVisionEncoder, probe: torch.nn.Linear, batch: Batch,
                   media_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Mean next-token and MTP losses over completion tokens, image features in place of the placeholders (row-major
    order, the order the engine scatters them in), the probe's loss on the image tokens' cells (0 without pictures);
    also the next-token loss of the rows with a picture (for the log, nan when there are none)."""
    embeds = model.model.embed_tokens(batch.ids)
    probe_loss = embeds.new_zeros(())
    if batch.pixels is not None:
        features = torch.cat(encoder(batch.pixels, batch.grids))
        probe_loss = F.cross_entropy(probe(features), batch.cells)
        embeds = embeds.masked_scatter((batch.ids == media_pad).unsqueeze(-1), features.to(embeds.dtype))
    logits, mtp_logits = model(batch.ids, token_mask=batch.valid, with_mtp=True, inputs_embeds=embeds)
    v = logits.shape[-1]
    ids, target = batch.ids, batch.target
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none")
    mask = target[:, 1:]
    main = per_token.view(mask.shape)[mask].mean()
    mtp = F.cross_entropy(mtp_logits[:, :-1][target[:, 2:]].view(-1, v), ids[:, 2:][target[:, 2:]])
    with torch.no_grad():
        pictured = mask & (ids == media_pad).any(1, keepdim=True)
        image_loss = per_token.view(mask.shape)[pictured].mean().item() if pictured.any() else float("nan")
    return main, mtp, probe_loss, image_loss


def _interleave_rotary_pairs(wqkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Our fused qkv rows (rotary pairs (i, i + head_dim / 2)) in Moonshot's order (pairs (2i, 2i + 1)); the inverse of
    kimi_vision._split_rotary_pairs."""
    q, k, v = wqkv.chunk(3)

    def interleave(rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(num_heads, 2, -1, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)

    return torch.cat([interleave(q), interleave(k), v])


def vision_tensors(encoder: KimiVisionEncoder) -> dict[str, torch.Tensor]:
    """The tower and projector under Moonshot's checkpoint names."""
    out = {}
    for name, param in encoder.named_parameters():
        tensor = param.detach().contiguous().clone()
        if name.endswith(("qkv.weight", "qkv.bias")):
            tensor = _interleave_rotary_pairs(tensor, encoder.config.num_heads).contiguous()
        out[_checkpoint_name(name)] = tensor
    return out


def kimi_config(text: TinyConfig, ids: dict[str, int]) -> dict:
    """config.json: DeepSeek-V3 text config under text_config, the tower under vision_config (transformers' names),
    the projector and media token ids on the outer config."""
    return {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text.to_hf_config(),
        "vision_config": {"model_type": "kimi_k25_vision", **VISION},
        "projection_hidden_size": VISION["hidden_size"],
        "projection_layer_norm_eps": 1e-5,
        "image_token_id": ids[MEDIA_PAD],
        "vision_start_token_id": ids[MEDIA_BEGIN],
        "vision_end_token_id": ids[MEDIA_END],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def processor_config() -> dict:
    """processor_config.json in transformers' Kimi_K25Processor format (read by MediaProcessor.from_model_dir)."""
    image = {"image_processor_type": "Kimi_K25ImageProcessor", "patch_size": PIXELS.patch_size,
             "merge_size": PIXELS.merge_size, "max_patches": PIXELS.max_patches,
             "size": {"max_height": PIXELS.max_patches_per_side, "max_width": PIXELS.max_patches_per_side},
             "image_mean": list(PIXELS.image_mean), "image_std": list(PIXELS.image_std),
             "rescale_factor": PIXELS.rescale_factor, "resample": 3}
    video = {**image, "video_processor_type": "Kimi_K25VideoProcessor", "fps": 2.0, "temporal_patch_size": 4}
    del video["image_processor_type"]
    return {"processor_class": "Kimi_K25Processor", "image_processor": image, "video_processor": video}


def save_kimi_checkpoint(model: TinyDeepseekV3, encoder: KimiVisionEncoder, tokenizer: Tokenizer,
                         out_dir: Path) -> None:
    """Write the whole checkpoint into a sibling temporary folder, then swap it in for out_dir."""
    out_dir = out_dir.resolve()
    tmp = out_dir.with_name(out_dir.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = {t: tokenizer.token_to_id(t) for t in MEDIA_TOKENS}
    tensors = {f"language_model.{k}": v for k, v in model.state_dict_for_checkpoint().items()}
    tensors.update(vision_tensors(encoder))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(kimi_config(model.cfg, ids), indent=2) + "\n")
    (tmp / "processor_config.json").write_text(json.dumps(processor_config(), indent=2) + "\n")
    tokenizer.save(str(tmp / "tokenizer.json"))
    tok_cfg = tokenizer_config(MAX_MODEL_LEN)
    tok_cfg["additional_special_tokens"] += MEDIA_TOKENS
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    write_generation_config(tmp, tokenizer.token_to_id(IM_END), tokenizer.token_to_id(PAD))
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def lr_scale(step: int, done: float, warmup: int) -> float:
    """Linear warm-up, then cosine from 1 to 0.05 over the run's progress."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def train(args: VisionTrainArgs) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    if not (args.base / "config.json").is_file():
        raise FileNotFoundError(f"no text model in {args.base}: train one with `python -m reasoning_engine.tiny.train "
                                f"--out-dir {args.base}` or pass --base")
    tokenizer = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    ids = add_media_tokens(tokenizer)
    model = widen_vocab(load_checkpoint(args.base), tokenizer.get_vocab_size()).train()
    encoder = KimiVisionEncoder(vision_config(model.cfg.hidden_size))
    probe = torch.nn.Linear(model.cfg.hidden_size, NUM_CELL_LABELS)
    with torch.no_grad():
        torch.nn.init.normal_(encoder.pos_emb, std=0.02)
        # Image tokens start at a word embedding's scale (~1), not torch's default (~5), so they are not swamped.
        torch.nn.init.normal_(encoder.projector.out_proj.weight, std=0.02)
        encoder.projector.out_proj.bias.zero_()
    print(f"text model from {args.base}: vocab {model.cfg.vocab_size} (media tokens {ids}); vision tower + projector "
          f"{sum(p.numel() for p in encoder.parameters()):,} parameters", flush=True)
    lm_decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    lm_rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    vis_decay = [p for p in [*encoder.parameters(), *probe.parameters()] if p.dim() >= 2]
    vis_rest = [p for p in [*encoder.parameters(), *probe.parameters()] if p.dim() < 2]
    groups = [{"params": lm_decay, "weight_decay": 0.05, "peak": args.lm_lr},
              {"params": lm_rest, "weight_decay": 0.0, "peak": args.lm_lr},
              {"params": vis_decay, "weight_decay": 0.05, "peak": args.lr},
              {"params": vis_rest, "weight_decay": 0.0, "peak": args.lr}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    media_pad = ids[MEDIA_PAD]
    args.log_file.parent.mkdir(parents=True, exist_ok=True)
    queue: list[Batch] = []
    next_pool, step = 0, 0
    train_start = time.time()
    with open(args.log_file, "w", newline="") as log_f:
        log = csv.writer(log_f)
        log.writerow(["step", "loss", "mtp_loss", "image_loss", "probe_loss", "lr_lm", "lr_vision", "elapsed_s",
                      "max_expert_load"])
        bar = tqdm(total=args.steps, desc="train_vision", dynamic_ncols=True, mininterval=2.0)
        while True:
            done = max(step / args.steps, (time.time() - train_start) / (60 * args.max_minutes))
            if done >= 1.0:
                break
            if not queue:
                queue = make_pool(args.seed, next_pool, args.pool_size, args.tokens_per_batch, tokenizer)
                next_pool += 1
            batch = queue.pop()
            scale = lr_scale(step, done, args.warmup)
            for group in opt.param_groups:
                group["lr"] = group["peak"] * scale
            main, mtp, probe_loss, image_loss = forward_losses(model, encoder, probe, batch, media_pad)
            opt.zero_grad(set_to_none=True)
            (main + MTP_WEIGHT * mtp + PROBE_WEIGHT * probe_loss).backward()
            torch.nn.utils.clip_grad_norm_([*model.parameters(), *encoder.parameters(), *probe.parameters()], 1.0)
            opt.step()
            # Slower than from scratch (train.py's 1e-2): the experts are balanced already.
            load = update_routing_bias(model, 1e-3 * scale)
            step += 1
            bar.update(1)
            if step % 25 == 0 or step == 1:
                bar.set_postfix(loss=f"{main.item():.3f}", image=f"{image_loss:.3f}", probe=f"{probe_loss.item():.3f}")
                log.writerow([step, f"{main.item():.4f}", f"{mtp.item():.4f}", f"{image_loss:.4f}",
                              f"{probe_loss.item():.4f}",
                              f"{args.lm_lr * scale:.2e}",
                              f"{args.lr * scale:.2e}", f"{time.time() - start:.0f}", f"{load.item():.2f}"])
                log_f.flush()
        bar.close()
    model.eval()
    encoder.eval()
    save_kimi_checkpoint(model, encoder, tokenizer, args.out_dir)
    print(f"done in {(time.time() - start) / 60:.1f} min, {step} steps; saved to {args.out_dir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE,
                        help="the text-only model to start from (train.py's output)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: the bundled assets (--quick: artifacts/tiny/vision_quick)")
    parser.add_argument("--max-minutes", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: until --max-minutes)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 10 steps")
    parser.add_argument("--tokens-per-batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the vision tower")
    parser.add_argument("--lm-lr", type=float, default=5e-4, help="peak learning rate of the language model")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--pool-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=VISION_TRAIN_SEED)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-file", type=Path, default=Path("artifacts/tiny/train_vision_log.csv"))
    ns = parser.parse_args(argv)
    steps = ns.steps or (10 if ns.quick else 1_000_000)
    out_dir = ns.out_dir or (Path("artifacts/tiny/vision_quick") if ns.quick else BUNDLED_MODEL_DIR)
    train(VisionTrainArgs(base=ns.base, out_dir=out_dir, log_file=ns.log_file, max_minutes=ns.max_minutes,
                          steps=steps, tokens_per_batch=ns.tokens_per_batch, lr=ns.lr, lm_lr=ns.lm_lr,
                          warmup=min(ns.warmup, steps // 10 + 1), pool_size=64 if ns.quick else ns.pool_size,
                          seed=ns.seed, threads=ns.threads))


if __name__ == "__main__":
    main()
