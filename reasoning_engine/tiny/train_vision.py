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
(deep supervision, Lee et al., 2015, "Deeply-Supervised Nets"); a second probe names each token's cell, so its
position is readable too. Where to look is taught directly as well: the thinking scans the picture cell by cell
(``vision_data.scan``), and one attention head is trained to attend from each scan item to its cell's image tokens and
to read that cell's content there (a third probe on the head's output). The routing biases keep being balanced as in
``train.py``. The language model trains at a lower learning rate than the new tower. The run is a fixed number of
steps (``DEFAULT_STEPS``, 30 minutes of a quiet 2-core CPU); ``--max-minutes`` optionally caps the wall time as well
(the cosine schedule then ends by the cap).

``--init DIR`` goes on training a kimi_k25 checkpoint (the bundled one) instead: its probes are new, so they first fit
alone (``--probe-steps``). ``--tower-steps N`` first trains the tower and its probe alone on batches of fresh pictures
(cheap next to the language model), and ``--tower-extra`` adds pictures that only the tower sees to every joint step:
on varied pictures (``vision_data``) telling shapes apart at any size and place is most of the work.
``--freeze-lm`` trains only the tower, projector and probes (through the frozen language model's losses): the
language model's weights and routing biases stay exactly as in ``--init``, so every text reply does too.
``--save-every`` writes the checkpoint as it goes, so a run stopped early keeps its last one.

The result is a ``kimi_k25`` checkpoint with Moonshot's tensor names (``language_model.model.*``,
``vision_tower.*``, ``mm_projector.*``), a config both our engine and transformers' ``Kimi_K25Config`` read, the
processor settings (8-pixel patches, at most 8 a side) and a tokenizer whose chat template renders image parts as
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
from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

from reasoning_engine.models.kimi_vision import (  # noqa: E402
    KimiVisionEncoder,
    VisionConfig,
    _checkpoint_name,
    build_vision_encoder,
)
from reasoning_engine.multimodal.processing import patch_rows, rgb_pixels  # noqa: E402
from reasoning_engine.tiny import BUNDLED_MODEL_DIR  # noqa: E402
from reasoning_engine.tiny.chat_format import IM_END, MEDIA_BEGIN, MEDIA_END, MEDIA_PAD, MEDIA_TOKENS, PAD  # noqa: E402
from reasoning_engine.tiny.data import GENERATORS, TRAIN_MIX, Sample, decorate, training_sample  # noqa: E402
from reasoning_engine.tiny.model import TinyConfig, TinyDeepseekV3, load_checkpoint  # noqa: E402
from reasoning_engine.tiny.tokenizer import tokenizer_config  # noqa: E402
from reasoning_engine.tiny.train import (  # noqa: E402
    MAX_MODEL_LEN,
    MTP_WEIGHT,
    keeps_thread_count,
    update_routing_bias,
    write_generation_config,
)
from reasoning_engine.tiny.vision_data import (  # noqa: E402
    CELL_NAMES,
    GRID,
    ITEM_MARK,
    NUM_CELL_LABELS,
    PIXELS,
    SCAN_ORDER,
    VISION_TRAIN_SEED,
    content_label,
    training_image_sample,
)

DEFAULT_BASE = Path("artifacts/tiny/text")
# PIXELS (vision_data): 8-pixel patches merged 2 x 2; the processor scales a picture until its longer side is at most
# 8 patches, so every picture reaches the tower at most 64 pixels a side, as it was trained.
VISION = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4, patch_size=8,
              pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, merge_kernel_size=[2, 2],
              hidden_act="gelu_pytorch_tanh")
# Shares of the training samples: pictures, the two text gaps, and the text replay (which holds the gaps too). Run 3
# (pictures 45%, text 40%, the gaps drawn evenly) fell one problem short on comparison and on letters in words with
# doubled letters while sorting with one-digit numbers reached 99%, so the replay now weighs letters and comparison
# more, and the gaps lean to the letters.
MIX = {"image": 0.42, "gap": 0.15, "text": 0.43}
# The budget: what 30 minutes give on a quiet 2-core CPU (OMP_NUM_THREADS=2: ~1.5 steps/s over steps 25-125 of short
# runs of this recipe), as a step count so that a busy machine changes the wall time, not the result.
DEFAULT_STEPS = 2700
GAP_MIX = {"letters_doubled": 0.6, "sorting_one_digit": 0.4}
# Telling shapes apart at any size and place is most of the work on varied pictures, and the tower is cheap next to
# the language model: each step also shows it this many more pictures, with the probe's loss alone.
TOWER_EXTRA = 24
TOWER_BATCH = 64  # pictures per step of the tower-only steps (--tower-steps) before the joint ones
PROBE_WEIGHT = 1.0
# The lookup the scan needs, taught directly: one head of the second layer (the first holds the previous-token head, so
# this one's query can know the cell name of the item it is in) is trained to attend from each scan item's name and
# colour token to the image tokens standing for the item's cell (vision_data.token_targets), and what it reads there
# (its output for that token) must name the cell's content to a second training-only probe. (Head 4, the one the text
# model uses least, with the language model's rate at 5e-4 kept the text tasks no better and counted worse:
# docs/tiny-reasoner.md.)
LOOKUP_LAYER, LOOKUP_HEAD, LOOKUP_WEIGHT = 1, 7, 1.0
# Comparison, the text task training on varied pictures set back most (97% -> 93%), is replayed most.
TEXT_MIX = {**TRAIN_MIX, "letters": 0.22, "comparison": 0.25, "letters_doubled": 0.08, "sorting_one_digit": 0.06}


@dataclass
class VisionTrainArgs:
    base: Path
    init: Path | None  # a kimi_k25 checkpoint to go on training (language model and tower) instead of `base`
    out_dir: Path
    log_file: Path
    max_minutes: float | None
    steps: int
    tokens_per_batch: int
    lr: float  # the vision tower's and projector's peak
    lm_lr: float  # the language model's peak
    warmup: int
    pool_size: int
    seed: int
    threads: int
    save_every: int | None = None
    probe_steps: int = 0  # steps at the start that train only the probes
    tower_extra: int = 0  # pictures per step that only the tower and its probe see
    tower_steps: int = 0  # tower-only steps before the joint ones
    image_share: float = MIX["image"]  # share of picture questions among the joint steps' samples
    freeze_lm: bool = False  # train only the tower, projector and probes; the language model stays as it was


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
    cells: torch.Tensor | None  # per image token: the content label of the shape whose centre it holds
    positions: torch.Tensor | None  # per image token: the cell of that centre (or of its own centre)
    lookups: torch.Tensor | None  # [N, 3]: batch row, a scan token's position, the content label of its item's cell
    lookup_keys: torch.Tensor | None  # [N, width]: the image token positions the look-up may read


def sample_mix(rng: random.Random, image_share: float = MIX["image"]) -> Sample:
    """A picture question with probability `image_share`, else a text-gap or replayed text sample (MIX's ratio)."""
    weights = {kind: (image_share if kind == "image" else share * (1 - image_share) / (1 - MIX["image"]))
               for kind, share in MIX.items()}
    kind = rng.choices(list(weights), weights=list(weights.values()))[0]
    if kind == "image":
        return training_image_sample(rng)
    if kind == "gap":
        return decorate(GENERATORS[rng.choices(list(GAP_MIX), weights=list(GAP_MIX.values()))[0]](rng), rng)
    return training_sample(rng, TEXT_MIX)


def scan_lookups(completion: list[int], offset: int, tokenizer: Tokenizer) -> list[tuple[int, int]]:
    """(position, cell in raster order) for each scan item's cell-name token and, in a filled cell, its colour token:
    the scan is the line that opens with the first `|`, each item is `|`, a name of CELL_NAMES (in SCAN_ORDER), then
    `-` or the content."""
    names = {tokenizer.token_to_id(name): i for i, name in enumerate(CELL_NAMES)}
    mark = tokenizer.token_to_id(ITEM_MARK)
    out: list[tuple[int, int]] = []
    for i in range(completion.index(mark), len(completion) - 1):
        if "Ċ" in tokenizer.id_to_token(completion[i]):
            break
        if completion[i] != mark:
            continue
        row, col = SCAN_ORDER[names[completion[i + 1]]]
        out.append((offset + i + 1, row * GRID + col))
        if tokenizer.id_to_token(completion[i + 2]) != "-":
            out.append((offset + i + 2, row * GRID + col))
    return out


@dataclass
class Encoded:
    """One sample ready for batching: ids with each image placeholder widened to its tokens, the prompt length, each
    image's patch rows and grid, per image token its content label and cell, and per scan token the look-up target
    (its position, its cell's content label, the image token positions it may read)."""

    ids: list[int]
    prompt_len: int
    images: list[torch.Tensor]
    grids: list[tuple[int, int, int]]
    labels: list[int]
    positions: list[int]
    lookups: list[tuple[int, int, list[int]]]


def picture_rows(image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The processor's patch rows of a picture and its patch grid."""
    frames = torch.from_numpy(rgb_pixels(image)).permute(2, 0, 1).unsqueeze(0)
    rows, gh, gw = patch_rows(frames, PIXELS)
    return rows, (1, gh, gw)


def encode(sample: Sample, tokenizer: Tokenizer, pad_id: int) -> Encoded:
    images = [p["image_pil"] for m in sample.messages if isinstance(m["content"], list)
              for p in m["content"] if p.get("type") == "image_pil"]
    rows, grids, per_image = [], [], []
    for image in images:
        r, grid = picture_rows(image)
        rows.append(r)
        grids.append(grid)
        per_image.append(grid[1] * grid[2] // PIXELS.merge_size**2)
    # The prompt ends at an added token, so encoding prompt and completion apart equals encoding them together.
    prompt = tokenizer.encode(sample.prompt()).ids
    completion = tokenizer.encode(sample.completion()).ids
    widened: list[int] = []
    counts = iter(per_image)
    for token in prompt:
        widened.extend([token] * next(counts) if token == pad_id else [token])
    labels, positions, lookups = [], [], []
    if images:
        labels, positions = sample.meta["token_labels"], sample.meta["token_cells"]
        if len(labels) != per_image[0] or len(images) != 1:
            raise ValueError(f"a picture sample has one image whose token labels match its {per_image[0]} tokens")
        start = widened.index(pad_id)
        end = start + per_image[0]  # the image's end marker: what a look-up into a cell no token stands for reads
        contents = {row * GRID + col: content_label(shape, colour)
                    for shape, colour, row, col in sample.meta["objects"]}
        lookups = [(query, contents.get(cell, 0), [start + t for t in sample.meta["cell_tokens"][cell]] or [end])
                   for query, cell in scan_lookups(completion, len(widened), tokenizer)]
    return Encoded(widened + completion, len(widened), rows, grids, labels, positions, lookups)


def make_pool(seed: int, index: int, size: int, tokens_per_batch: int, tokenizer: Tokenizer,
              tower_extra: int = 0, image_share: float = MIX["image"]) -> list[Batch]:
    """The `index`-th pool of fresh samples cut into length-bucketed batches (as train.pool_batches); each batch also
    carries `tower_extra` pictures that only the tower and its probe see."""
    rng = random.Random(seed * 1_000_003 + index)
    media_pad, pad = tokenizer.token_to_id(MEDIA_PAD), tokenizer.token_to_id(PAD)
    pool = [encode(sample_mix(rng, image_share), tokenizer, media_pad) for _ in range(size)]
    order = sorted(range(len(pool)), key=lambda i: len(pool[i].ids))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and len(pool[i].ids) * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    batches = []
    for group in groups:
        width = max(len(pool[i].ids) for i in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        target = torch.zeros(len(group), width, dtype=torch.bool)
        rows: list[torch.Tensor] = []
        grids: list[tuple[int, int, int]] = []
        cells: list[int] = []
        positions: list[int] = []
        lookups: list[tuple[int, int, int]] = []
        keys: list[list[int]] = []
        for row, i in enumerate(group):
            enc = pool[i]
            ids[row, : len(enc.ids)] = torch.tensor(enc.ids)
            valid[row, : len(enc.ids)] = True
            target[row, enc.prompt_len: len(enc.ids)] = True
            rows.extend(enc.images)
            grids.extend(enc.grids)
            cells.extend(enc.labels)
            positions.extend(enc.positions)
            for query, label, allowed in enc.lookups:
                lookups.append((row, query, label))
                keys.append(allowed)
        for _ in range(tower_extra):
            extra = training_image_sample(rng)
            pixels, grid = picture_rows(extra.meta["image"])
            rows.append(pixels)
            grids.append(grid)
            cells.extend(extra.meta["token_labels"])
            positions.extend(extra.meta["token_cells"])
        key_mask = torch.zeros(len(keys), width, dtype=torch.bool)
        for n, allowed in enumerate(keys):
            key_mask[n, allowed] = True
        batches.append(Batch(ids, valid, target, torch.cat(rows) if rows else None, grids,
                             torch.tensor(cells) if rows else None, torch.tensor(positions) if rows else None,
                             torch.tensor(lookups) if lookups else None, key_mask if lookups else None))
    return batches


def lookup_loss(attn: torch.nn.Module, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                lookups: torch.Tensor, keys: torch.Tensor, readout: torch.nn.Linear) -> torch.Tensor:
    """Mean negative log of the LOOKUP_HEAD's attention from each scan token to the image tokens of its cell (the
    one holding the cell's shape, else any that holds none), plus the readout probe's loss naming the cell's content
    from that head's output."""
    q, k, v = attn._qkv(*inputs)
    batch_row, query, label = lookups.unbind(1)
    q = q[batch_row, LOOKUP_HEAD, query]  # [N, dim]
    k, v = k[batch_row, LOOKUP_HEAD], v[batch_row, LOOKUP_HEAD]  # [N, T, dim]
    scores = torch.einsum("nd,ntd->nt", q, k) * attn.scale
    causal = torch.arange(k.shape[1]).unsqueeze(0) <= query.unsqueeze(1)
    log_probs = scores.masked_fill(~causal, float("-inf")).log_softmax(-1)
    read = torch.einsum("nt,ntd->nd", log_probs.exp(), v)
    return -log_probs.masked_fill(~keys, float("-inf")).logsumexp(-1).mean() + F.cross_entropy(readout(read), label)


def tower_probe_loss(probe: torch.nn.Linear, features: torch.Tensor, cells: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, float]:
    """The probe's loss naming each image token's content and cell, and how often it names a shape token's content
    right (for the log)."""
    logits = probe(features)
    content = logits[:, :NUM_CELL_LABELS]
    loss = F.cross_entropy(content, cells) + F.cross_entropy(logits[:, NUM_CELL_LABELS:], positions)
    with torch.no_grad():
        shapes = cells > 0
        right = (content[shapes].argmax(-1) == cells[shapes]).float().mean().item() if shapes.any() else float("nan")
    return loss, right


def train_tower(encoder: KimiVisionEncoder, probe: torch.nn.Linear, args: VisionTrainArgs, log_file: Path) -> None:
    """Steps that train only the tower and its probe, on batches of TOWER_BATCH fresh pictures (cheap next to the
    language model's steps): telling shapes apart at any size and place is most of what varied pictures ask of it."""
    tower = [*encoder.parameters(), *probe.parameters()]
    opt = torch.optim.AdamW([{"params": [p for p in tower if p.dim() >= 2], "weight_decay": 0.05},
                             {"params": [p for p in tower if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = random.Random(args.seed * 1_000_003 - 1)
    start = time.time()
    with open(log_file, "w", newline="") as log_f:
        log = csv.writer(log_f)
        log.writerow(["step", "probe_loss", "shape_tokens_right", "lr", "elapsed_s"])
        for step in tqdm(range(args.tower_steps), desc="tower", dynamic_ncols=True, mininterval=2.0):
            scale = lr_scale(step, step / args.tower_steps, args.warmup)
            for group in opt.param_groups:
                group["lr"] = args.lr * scale
            pictures = [training_image_sample(rng) for _ in range(TOWER_BATCH)]
            rows, grids = zip(*(picture_rows(p.meta["image"]) for p in pictures))
            cells = torch.tensor([label for p in pictures for label in p.meta["token_labels"]])
            positions = torch.tensor([cell for p in pictures for cell in p.meta["token_cells"]])
            loss, right = tower_probe_loss(probe, torch.cat(encoder(torch.cat(rows), list(grids))), cells, positions)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(tower, 1.0)
            opt.step()
            if (step + 1) % 25 == 0 or step == 0:
                log.writerow([step + 1, f"{loss.item():.4f}", f"{right:.3f}", f"{args.lr * scale:.2e}",
                              f"{time.time() - start:.0f}"])
                log_f.flush()


def forward_losses(model: TinyDeepseekV3, encoder: KimiVisionEncoder, probe: torch.nn.Linear,
                   readout: torch.nn.Linear, batch: Batch, media_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Mean next-token and MTP losses over completion tokens, image features in place of the placeholders (row-major
    order, the order the engine scatters them in), the probe's loss on the image tokens' cells and positions and the
    lookup head's loss (0 without pictures); also the next-token loss of the rows with a picture (for the log, nan
    when there are none)."""
    embeds = model.model.embed_tokens(batch.ids)
    attn = model.model.layers[LOOKUP_LAYER].self_attn
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    hook = attn.register_forward_pre_hook(lambda _module, inputs: captured.append(inputs))
    probe_loss = embeds.new_zeros(())
    if batch.pixels is not None:
        features = torch.cat(encoder(batch.pixels, batch.grids))
        probe_loss, _ = tower_probe_loss(probe, features, batch.cells, batch.positions)
        placeholders = batch.ids == media_pad
        # Pictures past the prompts' own (make_pool's tower_extra) train only the tower and the probe.
        features = features[: int(placeholders.sum())]
        embeds = embeds.masked_scatter(placeholders.unsqueeze(-1), features.to(embeds.dtype))
    try:
        logits, mtp_logits = model(batch.ids, token_mask=batch.valid, with_mtp=True, inputs_embeds=embeds)
    finally:
        hook.remove()
    lookup = (lookup_loss(attn, captured[0], batch.lookups, batch.lookup_keys, readout) if batch.lookups is not None
              else probe_loss.new_zeros(()))
    v = logits.shape[-1]
    ids, target = batch.ids, batch.target
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none")
    mask = target[:, 1:]
    main = per_token.view(mask.shape)[mask].mean()
    mtp = F.cross_entropy(mtp_logits[:, :-1][target[:, 2:]].view(-1, v), ids[:, 2:][target[:, 2:]])
    with torch.no_grad():
        pictured = mask & (ids == media_pad).any(1, keepdim=True)
        image_loss = per_token.view(mask.shape)[pictured].mean().item() if pictured.any() else float("nan")
    return main, mtp, probe_loss, lookup, image_loss


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


def starting_point(args: VisionTrainArgs) -> tuple[TinyDeepseekV3, KimiVisionEncoder, Tokenizer, dict[str, int]]:
    """The language model, tower, tokenizer and media token ids to train: a kimi_k25 checkpoint's (`--init`), or the
    text-only model's with the media tokens added and a new tower."""
    if args.init is not None:
        tokenizer = Tokenizer.from_file(str(args.init / "tokenizer.json"))
        ids = {t: tokenizer.token_to_id(t) for t in MEDIA_TOKENS}
        model = load_checkpoint(args.init).train()
        encoder = build_vision_encoder(args.init, torch.float32, "cpu")
        if encoder is None:
            raise ValueError(f"--init {args.init} is not a kimi_k25 checkpoint with a vision tower")
        encoder.requires_grad_(True).train()
        print(f"model and tower from {args.init}", flush=True)
        return model, encoder, tokenizer, ids
    if not (args.base / "config.json").is_file():
        raise FileNotFoundError(f"no text model in {args.base}: train one with `python -m reasoning_engine.tiny.train "
                                f"--out-dir {args.base}` or pass --base")
    tokenizer = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    ids = add_media_tokens(tokenizer)
    model = widen_vocab(load_checkpoint(args.base), tokenizer.get_vocab_size()).train()
    encoder = KimiVisionEncoder(vision_config(model.cfg.hidden_size))
    with torch.no_grad():
        torch.nn.init.normal_(encoder.pos_emb, std=0.02)
        # Image tokens start at a word embedding's scale (~1), not torch's default (~5), so they are not swamped.
        torch.nn.init.normal_(encoder.projector.out_proj.weight, std=0.02)
        encoder.projector.out_proj.bias.zero_()
    print(f"text model from {args.base}: vocab {model.cfg.vocab_size} (media tokens {ids}); vision tower + projector "
          f"{sum(p.numel() for p in encoder.parameters()):,} parameters", flush=True)
    return model, encoder, tokenizer, ids


@keeps_thread_count
def train(args: VisionTrainArgs) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    model, encoder, tokenizer, ids = starting_point(args)
    probe = torch.nn.Linear(model.cfg.hidden_size, NUM_CELL_LABELS + GRID * GRID)
    readout = torch.nn.Linear(model.cfg.v_head_dim, NUM_CELL_LABELS)
    lm_decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    lm_rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    vision_params = [*encoder.parameters(), *probe.parameters(), *readout.parameters()]
    probes = [*probe.parameters(), *readout.parameters()]
    tower = list(encoder.parameters())
    groups = [] if args.freeze_lm else [{"params": lm_decay, "weight_decay": 0.05, "peak": args.lm_lr},
                                        {"params": lm_rest, "weight_decay": 0.0, "peak": args.lm_lr}]
    if args.freeze_lm:
        # The language model's weights and routing biases stay as they were, so its text replies do too; the tower
        # learns through it (the gradients still flow back through its activations).
        model.requires_grad_(False)
    groups += [{"params": [p for p in tower if p.dim() >= 2], "weight_decay": 0.05, "peak": args.lr},
              {"params": [p for p in tower if p.dim() < 2], "weight_decay": 0.0, "peak": args.lr},
              {"params": probes, "weight_decay": 0.0, "peak": args.lr, "probe": True}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    media_pad = ids[MEDIA_PAD]
    args.log_file.parent.mkdir(parents=True, exist_ok=True)
    if args.tower_steps:
        tower_log = args.log_file.with_name(args.log_file.stem + "_tower.csv")
        train_tower(encoder, probe, args, tower_log)
        print(f"{args.tower_steps} tower steps in {(time.time() - start) / 60:.1f} min (log {tower_log})", flush=True)
        if args.save_every:
            save_kimi_checkpoint(model, encoder, tokenizer, args.out_dir)
    queue: list[Batch] = []
    next_pool, step = 0, 0
    train_start = time.time()
    with open(args.log_file, "w", newline="") as log_f:
        log = csv.writer(log_f)
        log.writerow(["step", "loss", "mtp_loss", "image_loss", "probe_loss", "lookup_loss", "lr_lm", "lr_vision", "elapsed_s",
                      "max_expert_load"])
        bar = tqdm(total=args.steps, desc="train_vision", dynamic_ncols=True, mininterval=2.0)
        while True:
            done = step / args.steps
            if args.max_minutes is not None:
                done = max(done, (time.time() - train_start) / (60 * args.max_minutes))
            if done >= 1.0:
                break
            if not queue:
                queue = make_pool(args.seed, next_pool, args.pool_size, args.tokens_per_batch, tokenizer,
                                  args.tower_extra, args.image_share)
                next_pool += 1
            batch = queue.pop()
            # New probes on a trained model (--init) first fit alone, so their first, random gradients do not move it.
            fitting = step < args.probe_steps
            scale = 0.0 if fitting else lr_scale(step - args.probe_steps, done, args.warmup)
            for group in opt.param_groups:
                group["lr"] = group["peak"] * (1.0 if fitting and group.get("probe") else scale)
            main, mtp, probe_loss, lookup, image_loss = forward_losses(model, encoder, probe, readout, batch, media_pad)
            opt.zero_grad(set_to_none=True)
            (main + MTP_WEIGHT * mtp + PROBE_WEIGHT * probe_loss + LOOKUP_WEIGHT * lookup).backward()
            torch.nn.utils.clip_grad_norm_([*model.parameters(), *vision_params], 1.0)
            opt.step()
            # Slower than from scratch (train.py's 1e-2): the experts are balanced already.
            load = update_routing_bias(model, 0.0 if args.freeze_lm else 1e-3 * scale)
            step += 1
            bar.update(1)
            if step % 25 == 0 or step == 1:
                bar.set_postfix(loss=f"{main.item():.3f}", image=f"{image_loss:.3f}", probe=f"{probe_loss.item():.3f}",
                                lookup=f"{lookup.item():.3f}")
                log.writerow([step, f"{main.item():.4f}", f"{mtp.item():.4f}", f"{image_loss:.4f}",
                              f"{probe_loss.item():.4f}", f"{lookup.item():.4f}",
                              f"{0.0 if args.freeze_lm else args.lm_lr * scale:.2e}",
                              f"{args.lr * scale:.2e}", f"{time.time() - start:.0f}", f"{load.item():.2f}"])
                log_f.flush()
            if args.save_every and step % args.save_every == 0:
                save_kimi_checkpoint(model, encoder, tokenizer, args.out_dir)
        bar.close()
    model.eval()
    encoder.eval()
    save_kimi_checkpoint(model, encoder, tokenizer, args.out_dir)
    print(f"done in {(time.time() - start) / 60:.1f} min, {step} steps; saved to {args.out_dir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE,
                        help="the text-only model to start from (train.py's output)")
    parser.add_argument("--init", type=Path, default=None,
                        help="instead of --base: a kimi_k25 checkpoint (e.g. the bundled assets) to go on training")
    parser.add_argument("--probe-steps", type=int, default=None,
                        help="steps that first fit the new probes alone (default: 100 with --init, else 0)")
    parser.add_argument("--tower-extra", type=int, default=TOWER_EXTRA,
                        help="pictures per step that only the tower and its probe see")
    parser.add_argument("--tower-steps", type=int, default=0,
                        help=f"first train only the tower and its probe for this many steps of {TOWER_BATCH} pictures")
    parser.add_argument("--image-share", type=float, default=MIX["image"],
                        help="share of picture questions in the joint steps (the text samples share the rest)")
    parser.add_argument("--freeze-lm", action="store_true",
                        help="train only the tower, projector and probes: the language model (and so every text "
                             "reply) stays exactly as in --init")
    parser.add_argument("--save-every", type=int, default=None,
                        help="also write the checkpoint to --out-dir every N steps (a run stopped early keeps it)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: the bundled assets (--quick: artifacts/tiny/vision_quick)")
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {DEFAULT_STEPS})")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="also stop (the schedule ending then) after this many minutes")
    parser.add_argument("--quick", action="store_true", help="smoke test: 10 steps")
    parser.add_argument("--tokens-per-batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the vision tower")
    parser.add_argument("--lm-lr", type=float, default=8e-4, help="peak learning rate of the language model")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--pool-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=VISION_TRAIN_SEED)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-file", type=Path, default=Path("artifacts/tiny/train_vision_log.csv"))
    ns = parser.parse_args(argv)
    steps = ns.steps or (10 if ns.quick else DEFAULT_STEPS)
    out_dir = ns.out_dir or (Path("artifacts/tiny/vision_quick") if ns.quick else BUNDLED_MODEL_DIR)
    probe_steps = ns.probe_steps if ns.probe_steps is not None else (100 if ns.init and not ns.quick else 0)
    train(VisionTrainArgs(base=ns.base, init=ns.init, save_every=ns.save_every, probe_steps=probe_steps,
                          tower_extra=ns.tower_extra, tower_steps=ns.tower_steps, image_share=ns.image_share,
                          freeze_lm=ns.freeze_lm,
                          out_dir=out_dir, log_file=ns.log_file, max_minutes=ns.max_minutes,
                          steps=steps, tokens_per_batch=ns.tokens_per_batch, lr=ns.lr, lm_lr=ns.lm_lr,
                          warmup=min(ns.warmup, steps // 10 + 1), pool_size=64 if ns.quick else ns.pool_size,
                          seed=ns.seed, threads=ns.threads))


if __name__ == "__main__":
    main()
