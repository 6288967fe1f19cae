"""Reading a Hugging Face checkpoint folder tensor by tensor.

Tensors come from the memory-mapped safetensors files one at a time, so loading never holds a second copy of the
model. A touched page of a mapping stays resident (and counts in RSS) for as long as the file is open, so each file is
reopened after a bounded number of bytes has been read from it: resident file pages stay under that bound and peak
RSS stays near the size of the loaded weights. Every yielded tensor owns its memory (never a view of the mapping).

Quantized layers are dequantized on the fly (see `quantization`): the consumer sees the logical ``X.weight`` as a
dense tensor and never the ``weight_packed`` / ``weight_scale`` / ``weight_scale_inv`` companions, except for the
layers it asks to keep packed (``keep_packed``: the routed experts the model stores quantized), which come as their
stored parts, checked and in their stored dtypes.

`iter_checkpoint_tensors` yields each tensor as a `LazyTensor` that reads nothing until asked, and can read just a
part (a tensor-parallel rank's rows or columns): a quantized part is read from the enclosing scale groups or blocks
and cut after dequantizing. A rank that loads only its share so reads only its share.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from reasoning_engine.kernels.fused_moe import dequantize_mxfp4
from reasoning_engine.models.quantization import (
    INT4_PACK_FACTOR,
    dequantize_fp8_block,
    dequantize_fp8_channel,
    dequantize_int4_pack,
    e8m0_exponents,
)
from reasoning_engine.quant_config import QuantConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_RESIDENT_BYTES = 256 << 20  # reopen a file after reading this much from it (or 5% of the checkpoint if less)
MIN_RESIDENT_BYTES = 8 << 20

_INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")

Index = tuple[slice, ...]


@dataclass
class ReadCounter:
    """Bytes read from checkpoint files by this process (what a rank's sliced loading actually touched)."""

    bytes: int = 0


BYTES_READ = ReadCounter()


@dataclass(frozen=True)
class CheckpointTensor:
    """One logical tensor: its name as the model sees it, and the stored tensors it is read from."""

    name: str
    # "plain", "int4" (pack-quantized), "fp8" (block FP8), "fp4" (DeepSeek-V4's experts: e2m1 pairs and e8m0 scales
    # per 32, read with block FP8), "fp8_channel" (compressed-tensors FP8) or "mxfp4" (gpt-oss's stacked experts)
    kind: str
    parts: tuple[str, ...]  # stored tensor names: the tensor itself, or the quantized parts in _INT4_PARTS / weight order


def check_shape(name: str, expected: Sequence[int], actual: Sequence[int]) -> None:
    """Raise ValueError naming the tensor and both shapes when a checkpoint tensor does not fit the model."""
    if tuple(expected) != tuple(actual):
        raise ValueError(f"tensor {name!r} has shape {list(actual)} in the checkpoint, the model expects {list(expected)}")


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every stored tensor name to the safetensors file that holds it, checking that the folder is a checkpoint.

    Uses model.safetensors.index.json when present (and checks every shard it names exists), else model.safetensors,
    else every ``*.safetensors`` in the folder.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint folder {root} does not exist")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json: not a Hugging Face checkpoint folder")
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index (needs a 'weight_map' object): {exc}") from exc
        locations = {name: root / shard for name, shard in weight_map.items()}
        for name, path in locations.items():
            if not path.is_file():
                raise FileNotFoundError(f"{index.name} maps {name!r} to shard {path.name}, which is missing from {root}")
        return locations
    files = [root / SINGLE_FILE] if (root / SINGLE_FILE).is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(other)}: only safetensors checkpoints are supported)" if other else ""
        raise FileNotFoundError(f"no weights in {root}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards{hint}")
    locations = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in locations:
                    raise ValueError(f"tensor {name!r} is stored twice, in {locations[name].name} and {path.name}")
                locations[name] = path
    return locations


def read_tensors_where(model_dir: str | Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors whose stored names `wanted` accepts (a vision tower's), each file opened once; no
    other tensor is read."""
    by_file: dict[Path, list[str]] = {}
    for name, path in checkpoint_files(model_dir).items():
        if wanted(name):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def plan_checkpoint(locations: dict[str, Path], quant: QuantConfig | None) -> list[CheckpointTensor]:
    """Group stored tensors into logical ones: quantized parts become one ``X.weight``; order follows the files.
    Block FP8 scales are ``X.weight_scale_inv``, or under a block FP8 config ``X.scale`` (DeepSeek-V4's release)."""
    names = set(locations)
    short_scales = quant is not None and quant.method == "fp8"  # DeepSeek-V4 names a weight's scale X.scale
    consumed: set[str] = set()
    plan: list[CheckpointTensor] = []
    for stored in sorted(names, key=lambda n: (str(locations[n]), n)):
        if stored in consumed:
            continue
        if stored.endswith(".weight_packed"):
            base = stored[: -len(".weight_packed")]
            _require_quant(quant, "compressed-tensors", stored)
            parts = tuple(f"{base}.{part}" for part in _INT4_PARTS)
            missing = [p for p in parts if p not in names]
            if missing:
                raise ValueError(f"pack-quantized tensor {stored!r} has no {', '.join(repr(m) for m in missing)} in the checkpoint")
            if f"{base}.weight_zero_point" in names:
                raise ValueError(f"{base!r} has a weight_zero_point: asymmetric INT4 is not supported")
            plan.append(CheckpointTensor(f"{base}.weight", "int4", parts))
            consumed.update(parts)
        elif stored.endswith(".weight_scale_inv") or (short_scales and stored.endswith(".scale")
                                                       and f"{stored[: -len('.scale')]}.weight" in names):
            base = stored[: -len(".weight_scale_inv")] if stored.endswith(".weight_scale_inv") else stored[: -len(".scale")]
            if f"{base}.weight" not in names:
                raise ValueError(f"{stored!r} has no {base + '.weight'!r} to scale in the checkpoint")
            _require_quant(quant, "fp8", stored)
            plan.append(CheckpointTensor(f"{base}.weight", "fp8", (f"{base}.weight", stored)))
            consumed.update((f"{base}.weight", stored))
        elif stored.endswith(".weight_scale") and stored[: -len("scale")] + "packed" not in names:
            base = stored[: -len(".weight_scale")]
            if f"{base}.weight" not in names:
                raise ValueError(f"{stored!r} has no {base + '.weight'!r} to scale in the checkpoint")
            _require_quant(quant, "fp8-channel", stored)
            plan.append(CheckpointTensor(f"{base}.weight", "fp8_channel", (f"{base}.weight", stored)))
            consumed.update((f"{base}.weight", stored, f"{base}.input_scale"))
        elif stored.endswith("_blocks") and f"{stored[: -len('_blocks')]}_scales" in names:  # gpt-oss MXFP4 experts
            base = stored[: -len("_blocks")]
            _require_quant(quant, "mxfp4", stored)
            plan.append(CheckpointTensor(base, "mxfp4", (stored, f"{base}_scales")))
            consumed.update((stored, f"{base}_scales"))
        elif (not (stored.endswith(".weight") and (f"{stored}_scale_inv" in names
                                                    or (short_scales and f"{stored[: -len('weight')]}scale" in names)))
              and not _is_int4_part(stored, names)
              and not _is_fp8_channel_part(stored, names)
              and not (stored.endswith("_scales") and f"{stored[: -len('_scales')]}_blocks" in names)):
            plan.append(CheckpointTensor(stored, "plain", (stored,)))
            consumed.add(stored)
    return plan


def _is_int4_part(stored: str, names: set[str]) -> bool:
    """weight_scale / weight_shape of a pack-quantized layer are read with its weight_packed."""
    for part in _INT4_PARTS[1:]:
        if stored.endswith("." + part):
            return stored[: -len(part)] + "weight_packed" in names
    return False


def _is_fp8_channel_part(stored: str, names: set[str]) -> bool:
    """weight and input_scale of a compressed-tensors FP8 layer (a weight_scale without weight_packed) are read with
    its weight_scale; input_scale goes unused (activations are not quantized here)."""
    for part in (".weight", ".input_scale"):
        if stored.endswith(part):
            base = stored[: -len(part)]
            return f"{base}.weight_scale" in names and f"{base}.weight_packed" not in names
    return False


def _require_quant(quant: QuantConfig | None, method: str, stored: str) -> None:
    if quant is None or quant.method != method:
        found = "no quantization_config" if quant is None else f"quant_method {quant.method!r}"
        raise ValueError(f"checkpoint tensor {stored!r} is stored in {method} format but config.json has {found}")


def count_checkpoint_tensors(model_dir: str | Path, quant: QuantConfig | None = None, prefix_strip: str | None = None) -> int:
    """How many (name, tensor) pairs `iter_checkpoint_weights` yields for this folder."""
    plan = plan_checkpoint(checkpoint_files(model_dir), quant)
    return sum(1 for t in plan if prefix_strip is None or t.name.startswith(prefix_strip))


class _MappedFiles:
    """Open safetensors files, each reopened once `budget` bytes have been read from it (see the module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.handles: dict[Path, Any] = {}
        self.read_bytes: dict[Path, int] = {}

    def _handle(self, path: Path) -> Any:
        handle = self.handles.get(path)
        if handle is None:
            handle = self.handles[path] = safe_open(path, framework="pt")
            self.read_bytes[path] = 0
        return handle

    def shape(self, path: Path, name: str) -> list[int]:
        """A stored tensor's shape, from the file's header (no data read)."""
        try:
            return list(self._handle(path).get_slice(name).get_shape())
        except Exception as exc:  # safetensors raises its own error type for a name the file lacks
            raise ValueError(f"tensor {name!r} is listed for {path.name} but cannot be read from it: {exc}") from exc

    def stored_dtype(self, path: Path, name: str) -> str:
        """A stored tensor's safetensors dtype ("F8_E4M3", "I8", ...), from the file's header."""
        try:
            return self._handle(path).get_slice(name).get_dtype()
        except Exception as exc:
            raise ValueError(f"tensor {name!r} is listed for {path.name} but cannot be read from it: {exc}") from exc

    def get(self, path: Path, name: str, index: Index | None = None) -> torch.Tensor:
        """A stored tensor, or only its part `index` (slices per dimension, read without the rest)."""
        handle = self._handle(path)
        try:
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        except Exception as exc:  # safetensors raises its own error type for a name the file lacks
            raise ValueError(f"tensor {name!r} is listed for {path.name} but cannot be read from it: {exc}") from exc
        size = tensor.numel() * tensor.element_size()
        self.read_bytes[path] += size
        BYTES_READ.bytes += size
        return tensor

    def release_full(self) -> None:
        """Close files whose resident pages reached the budget; the mapping goes once no tensor views it."""
        for path in [p for p, n in self.read_bytes.items() if n >= self.budget and p in self.handles]:
            del self.handles[path]


def iter_checkpoint_weights(
    model_dir: str | Path,
    quant: QuantConfig | None,
    dtype: torch.dtype,
    prefix_strip: str | None = None,
    progress: bool = True,
    keep_packed: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_checkpoint_tensors`, each tensor read whole."""
    for name, tensor in iter_checkpoint_tensors(model_dir, quant, dtype, prefix_strip, progress, keep_packed):
        yield name, tensor.read()


def iter_checkpoint_tensors(
    model_dir: str | Path,
    quant: QuantConfig | None,
    dtype: torch.dtype,
    prefix_strip: str | None = None,
    progress: bool = True,
    keep_packed: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, LazyTensor]]:
    """Yield ``(name, LazyTensor)`` for every logical tensor of the checkpoint in ``model_dir``.

    Floating-point tensors (and dequantized ones) are read in ``dtype``; integer tensors keep theirs. With
    ``prefix_strip`` (e.g. ``"language_model."``) only tensors under that prefix are yielded, without it; the others
    (a vision tower) are skipped and counted in one log line. A quantized ``X.weight`` for which ``keep_packed(name)``
    holds is yielded as its stored parts instead: ``X.weight_packed`` (int32) and ``X.weight_scale`` for INT4,
    ``X.weight`` (float8_e4m3fn) and ``X.weight_scale_inv`` (float32) for block FP8, ``X_blocks`` and ``X_scales``
    (uint8) for gpt-oss's MXFP4 experts (dequantized, ``X`` is transformers' [E, in, out]). Files whose read bytes
    reach the resident budget are reopened between tensors, so read a tensor before asking for the next.
    """
    locations = checkpoint_files(model_dir)
    plan = plan_checkpoint(locations, quant)
    if prefix_strip is not None:
        outside = [t.name for t in plan if not t.name.startswith(prefix_strip)]
        if outside:
            groups = sorted({name.split(".", 1)[0] for name in outside})
            logger.info("skipping %d checkpoint tensors outside %r (%s)", len(outside), prefix_strip, ", ".join(groups))
        plan = [t for t in plan if t.name.startswith(prefix_strip)]
    total = sum(p.stat().st_size for p in set(locations.values()))
    files = _MappedFiles(max(MIN_RESIDENT_BYTES, min(MAX_RESIDENT_BYTES, total // 20)))
    plan = [_fp4_if_packed(entry, locations, files) for entry in plan]
    for entry in tqdm(plan, desc="Loading weights", unit="tensor", disable=not progress):
        name = entry.name[len(prefix_strip):] if prefix_strip else entry.name
        if entry.kind != "plain" and keep_packed is not None and keep_packed(name):
            parts = _packed_parts(entry, name, locations, files, quant)
        else:
            parts = [(name, _LogicalTensor(entry, locations, files, quant, dtype))]
        yield from parts
        files.release_full()


def _fp4_if_packed(entry: CheckpointTensor, locations: dict[str, Path], files: _MappedFiles) -> CheckpointTensor:
    """A block-FP8 entry whose weight is stored as bytes holds FP4 pairs with per-32 scales (DeepSeek-V4's experts)."""
    if entry.kind == "fp8" and files.stored_dtype(locations[entry.parts[0]], entry.parts[0]) in ("I8", "U8"):
        return CheckpointTensor(entry.name, "fp4", entry.parts)
    return entry


class LazyTensor(Protocol):
    """A checkpoint tensor read only when asked: whole, or one part of it (`read(index)`, slices per dimension).
    What `read` returns owns its memory (never a view of the file mapping)."""

    shape: list[int]

    def read(self, index: Index | None = None) -> torch.Tensor: ...


class _LogicalTensor:
    """A logical tensor: a dense one's part is read directly; a quantized one's from the enclosing INT4 scale groups
    or FP8 blocks, dequantized, then cut."""

    def __init__(self, entry: CheckpointTensor, locations: dict[str, Path], files: _MappedFiles,
                 quant: QuantConfig | None, dtype: torch.dtype) -> None:
        self.entry, self.locations, self.files, self.quant, self.dtype = entry, locations, files, quant, dtype
        self.shape = self._logical_shape()

    def _logical_shape(self) -> list[int]:
        entry = self.entry
        if entry.kind == "int4":
            return [int(v) for v in self._part(2).tolist()]
        if entry.kind == "mxfp4":  # blocks [E, out, in/32, 16] stand for transformers' [E, in, out]
            experts, out, groups, _ = self.files.shape(self.locations[entry.parts[0]], entry.parts[0])
            return [experts, groups * 32, out]
        shape = self.files.shape(self.locations[entry.parts[0]], entry.parts[0])
        if entry.kind == "fp4":  # two codes per byte
            return [*shape[:-1], 2 * shape[-1]]
        return shape

    def _part(self, i: int, index: Index | None = None) -> torch.Tensor:
        stored = self.entry.parts[i]
        return self.files.get(self.locations[stored], stored, index)

    def read(self, index: Index | None = None) -> torch.Tensor:
        entry = self.entry
        if entry.kind == "plain":
            tensor = self._part(0, index)
            if tensor.dtype == torch.float8_e4m3fn:
                raise ValueError(f"{entry.name!r} is stored as float8_e4m3fn without a weight_scale_inv")
            return tensor.to(dtype=self.dtype, copy=True) if tensor.is_floating_point() else tensor.clone()
        assert self.quant is not None
        if entry.kind == "mxfp4":  # read whole (only unpacked experts come here), then cut
            dense = dequantize_mxfp4(self._part(0).flatten(-2), self._part(1)).transpose(1, 2)
            return (dense[index] if index is not None else dense).to(self.dtype).contiguous()
        if entry.kind == "fp4":  # likewise
            codes, scales = _fp4_parts(entry, self._part(0), self._part(1))
            dense = dequantize_mxfp4(codes, scales)
            return (dense[index] if index is not None else dense).to(self.dtype).contiguous()
        rows, cols = _bounds(index, self.shape)
        if entry.kind == "int4":
            # whole scale groups of the columns (a group is a multiple of the eight values of an int32)
            group = self.quant.group_size
            c0, c1 = cols.start // group * group, cols.stop
            packed = self._part(0, (rows, slice(c0 // INT4_PACK_FACTOR, -(-c1 // INT4_PACK_FACTOR))))
            scale = self._part(1, (rows, slice(c0 // group, -(-c1 // group))))
            try:
                dense = dequantize_int4_pack(packed, scale, [rows.stop - rows.start, c1 - c0], group, self.dtype)
            except ValueError as exc:
                raise ValueError(f"cannot dequantize {entry.name!r}: {exc}") from exc
            return dense[:, cols.start - c0 :].contiguous()
        if entry.kind == "fp8_channel":
            weight, scale = self._part(0, (rows, cols)), self._part(1)
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{entry.parts[0]!r} has a weight_scale but is stored as {weight.dtype}, not float8_e4m3fn")
            try:
                return dequantize_fp8_channel(weight, scale.reshape(-1)[rows] if scale.numel() > 1 else scale, self.dtype)
            except ValueError as exc:
                raise ValueError(f"cannot dequantize {entry.name!r}: {exc}") from exc
        br, bc = self.quant.block  # whole FP8 blocks
        r0, c0 = rows.start // br * br, cols.start // bc * bc
        weight = self._part(0, (slice(r0, rows.stop), slice(c0, cols.stop)))
        scale_inv = self._part(1, (slice(r0 // br, -(-rows.stop // br)), slice(c0 // bc, -(-cols.stop // bc))))
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{entry.parts[0]!r} has a weight_scale_inv but is stored as {weight.dtype}, not float8_e4m3fn")
        try:
            dense = dequantize_fp8_block(weight, scale_inv, self.quant.block, self.dtype)
        except ValueError as exc:
            raise ValueError(f"cannot dequantize {entry.name!r}: {exc}") from exc
        return dense[rows.start - r0 :, cols.start - c0 :].contiguous()


def _bounds(index: Index | None, shape: Sequence[int]) -> tuple[slice, slice]:
    """Row and column ranges of a 2-D part (None: all of it), as slices with explicit start and stop."""
    index = tuple(index or ()) + (slice(None),) * (2 - len(index or ()))
    if len(shape) != 2 or len(index) != 2:
        raise ValueError(f"quantized tensors are 2-D [out, in], got shape {list(shape)} and index {index}")
    bounds = []
    for part, size in zip(index, shape):
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"a checkpoint tensor part must be contiguous, got step {step}")
        bounds.append(slice(start, stop))
    return bounds[0], bounds[1]


def _check_fp4(entry: CheckpointTensor, codes: Sequence[int], scales: Sequence[int]) -> None:
    """FP4 codes (two per byte) need one scale per 32 values."""
    if list(scales) != [*codes[:-1], codes[-1] * 2 // 32] or (codes[-1] * 2) % 32:
        raise ValueError(f"{entry.name!r}: FP4 codes {list(codes)} need one scale per 32 values, got scales "
                         f"{list(scales)}")


def _fp4_parts(entry: CheckpointTensor, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP4 weight's codes as bytes and its scales as e8m0 bytes, checked to fit."""
    _check_fp4(entry, codes.shape, scales.shape)
    try:
        return codes.view(torch.uint8), e8m0_exponents(scales)
    except ValueError as exc:
        raise ValueError(f"cannot read {entry.name!r}: {exc}") from exc


def _float32_scale(part: torch.Tensor) -> torch.Tensor:
    """A block-FP8 scale widened to the float32 the packed experts keep (exact from bf16, fp16 and e8m0)."""
    return part.to(torch.float32) if part.dtype in (torch.bfloat16, torch.float16, torch.float8_e8m0fnu) else part


class _StoredPart:
    """One stored part of a layer kept quantized, read as stored (no dtype cast), or through `convert` into the form
    the packed parameter keeps (exactly: Qwen's bf16 block-FP8 scales into float32, FP4 codes and scales as bytes)."""

    def __init__(self, stored: str, locations: dict[str, Path], files: _MappedFiles,
                 convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.stored, self.locations, self.files, self.convert = stored, locations, files, convert
        self.shape = files.shape(locations[stored], stored)

    def read(self, index: Index | None = None) -> torch.Tensor:
        part = self.files.get(self.locations[self.stored], self.stored, index)
        converted = self.convert(part) if self.convert is not None else part
        return converted.clone() if converted.data_ptr() == part.data_ptr() else converted


class _ChannelScale:
    """A compressed-tensors FP8 layer's scale as packed experts keep it (block FP8 with one-row blocks): float32
    [out, 1], one per output channel; a per-tensor scale is repeated. Exact: the stored scale is bf16 or float32."""

    def __init__(self, stored: str, rows: int, locations: dict[str, Path], files: _MappedFiles) -> None:
        self.stored, self.locations, self.files = stored, locations, files
        self.shape = [rows, 1]

    def read(self, index: Index | None = None) -> torch.Tensor:
        scale = self.files.get(self.locations[self.stored], self.stored).to(torch.float32).reshape(-1, 1)
        if scale.shape[0] == 1:
            scale = scale.expand(self.shape[0], 1)
        elif scale.shape[0] != self.shape[0]:
            raise ValueError(f"{self.stored!r} holds {scale.shape[0]} scales for {self.shape[0]} output channels")
        return (scale[index] if index is not None else scale).contiguous()


def _packed_parts(
    entry: CheckpointTensor, name: str, locations: dict[str, Path], files: _MappedFiles, quant: QuantConfig | None
) -> list[tuple[str, LazyTensor]]:
    """A quantized layer's stored parts as the packed expert parameters take them, named after ``name``'s layer;
    shapes and dtypes are checked from the file headers."""
    assert quant is not None
    if entry.kind == "mxfp4":
        blocks, scales = entry.parts
        return [(f"{name}_blocks", _StoredPart(blocks, locations, files)),
                (f"{name}_scales", _StoredPart(scales, locations, files))]
    base = name[: -len(".weight")]
    if entry.kind == "int4":
        packed, scale, shape = entry.parts
        rows, cols = (int(v) for v in files.get(locations[shape], shape).tolist())
        packed_shape, scale_shape = files.shape(locations[packed], packed), files.shape(locations[scale], scale)
        expected = ([rows, math.ceil(cols / INT4_PACK_FACTOR)], [rows, math.ceil(cols / quant.group_size)])
        if (packed_shape, scale_shape) != expected:
            raise ValueError(f"cannot read {entry.name!r}: weight_packed {packed_shape} and weight_scale {scale_shape} do "
                             f"not fit weight_shape {[rows, cols]} (expected {expected[0]} and {expected[1]})")
        if cols % INT4_PACK_FACTOR:
            raise ValueError(f"{entry.name!r} has {cols} input channels: kept packed, they must be a multiple of 8")
        return [(f"{base}.weight_packed", _StoredPart(packed, locations, files)),
                (f"{base}.weight_scale", _StoredPart(scale, locations, files))]
    if entry.kind == "fp8_channel":
        weight, scale = entry.parts
        rows = files.shape(locations[weight], weight)[0]
        return [(f"{base}.weight", _StoredPart(weight, locations, files)),
                (f"{base}.weight_scale", _ChannelScale(scale, rows, locations, files))]
    if entry.kind == "fp4":  # codes and e8m0 scales as the MXFP4 experts keep them (uint8)
        weight, scale = entry.parts
        _check_fp4(entry, files.shape(locations[weight], weight), files.shape(locations[scale], scale))
        return [(f"{base}.weight", _StoredPart(weight, locations, files, lambda t: t.view(torch.uint8))),
                (f"{base}.weight_scale_inv", _StoredPart(scale, locations, files, e8m0_exponents))]
    # float32 scales (DeepSeek-V3, MiniMax), bf16 (Qwen) or e8m0 (DeepSeek-V4), kept as float32
    weight, scale_inv = entry.parts
    return [(f"{base}.weight", _StoredPart(weight, locations, files)),
            (f"{base}.weight_scale_inv", _StoredPart(scale_inv, locations, files, _float32_scale))]
