"""Kernels a decode step launches, per layer: one greedy decode step of a Moonlight-shaped deepseek_v3 (random weights,
`load_format="dummy"`, config.json alone) on the Triton path, every Triton launch and every torch op that runs a
kernel counted and attributed to the decoder layer that issued it.

    python benchmarks/launch_count.py [--full-size] [--device cpu|cuda] [--draft-tokens 3]

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is
imported); the launches are the same ones a GPU step makes eagerly (a CUDA graph replays these same kernels). By
default the layers are gpu_check.py's TINY_CONFIG (Moonlight's structure: MLA without a query LoRA, one dense layer
then MoE layers with shared experts and a sigmoid noaux_tc router, at small widths), which launches what the
full-size model does: the kernels and ops depend on the structure, not the widths. `--full-size` uses Moonlight-16B-A3B's
own sizes (slow without a GPU). A verification step (a draft of `--draft-tokens` checked in one forward) is counted
too, under `verify_step`.

Counted: a Triton launch is a call of a JIT (or interpreted) kernel's `run` outside warm-up; a torch op is an aten op
seen by a TorchDispatchMode that is neither a view (`OpOverload.is_view`, unless its output has storage of its own:
a cast or a contiguous copy) nor an allocation alone (`NO_KERNEL`), and was not issued by the interpreter while it
runs a Triton kernel. The last line of stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# aten ops that only allocate or re-describe memory: no kernel runs for them
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
                       "detach_", "lift_fresh", "resize_", "set_", "_unsafe_view"})


@contextlib.contextmanager
def counting_launches(log: list[tuple[str, str, str]], scope: Callable[[], str] = lambda: "step") -> Iterator[None]:
    """Append (scope(), "triton" | "torch", name) to `log` for every kernel launched inside the block: Triton launches
    (JITFunction.run and the interpreter's InterpretedFunction.run, warm-ups left out) and the torch ops that run a
    kernel (views and bare allocations left out; the ops the interpreter itself runs inside a Triton launch too)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.jit import JITFunction

    classes: list[Any] = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    inside = [0]  # Triton launches in progress: the interpreter's own torch calls are no launches of the step

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            if not inside[0]:
                log.append((scope(), "triton", self.__name__))
            inside[0] += 1
            try:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                inside[0] -= 1

        return run

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            out = func(*args, **(kwargs or {}))
            if not inside[0] and name not in NO_KERNEL and (not func.is_view or _copied(args, out)):
                log.append((scope(), "torch", name))
            return out

    originals = {cls: cls.__dict__["run"] for cls in classes}
    for cls in classes:
        cls.run = wrap(originals[cls])
    try:
        with Ops():
            yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def _copied(args: Any, out: Any) -> bool:
    """Whether an op whose schema may alias its input (`to`, `contiguous`, `reshape`: seen whole under inference
    mode, where they are not decomposed) made a new tensor instead, a copy kernel."""
    import torch

    source = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return (isinstance(out, torch.Tensor) and source is not None
            and out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr())


def summarize(log: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Launches of one scope: total, Triton and torch counts, and each kernel / op with its count."""
    triton_ops = Counter(name for _, kind, name in log if kind == "triton")
    torch_ops = Counter(name for _, kind, name in log if kind == "torch")
    return {"total": len(log), "triton": sum(triton_ops.values()), "torch": sum(torch_ops.values()),
            "triton_kernels": dict(sorted(triton_ops.items())), "torch_ops": dict(sorted(torch_ops.items()))}


def count_decode_step(config: dict[str, Any], device: str = "cpu", prompt_len: int = 8,
                      draft_tokens: int = 0) -> dict[str, Any]:
    """Build the model from `config` (dummy weights, Triton kernels), prefill a prompt, then count the launches of the
    one decode step that follows, per decoder layer. Returns the per-layer summaries, the MoE and dense layers'
    (every MoE layer must launch the same kernels), and the launches outside the layers (embedding, final norm,
    LM head, sampling and the step's bookkeeping).

    With `draft_tokens`, the step counted is a verification step instead: n-gram speculation proposing up to that
    many tokens, over a prompt holding most of the vocabulary (so the last token recurs and a draft is proposed), and
    the first forward after the prefill with more than one query token is counted (`query_tokens` says how many)."""
    import torch

    from benchmarks.gpu_check import write_config
    from reasoning_engine import LLM, SamplingParams
    from reasoning_engine.layers.moe import Experts

    speculative = {"method": "ngram", "num_speculative_tokens": draft_tokens} if draft_tokens else None
    if draft_tokens:
        prompt_len = min(config["vocab_size"] - 3, config["max_position_embeddings"] - 40)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config(Path(tmp) / "model", config, int4=False)
        llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device=device, kernel_backend="triton",
                  enforce_eager=True, max_model_len=prompt_len + 32 if draft_tokens else 256, max_num_seqs=1,
                  speculative_config=speculative)
    model = llm.engine.runner.worker.model
    layers = next(m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    moe = [i for i, layer in enumerate(layers) if any(isinstance(m, Experts) for m in layer.modules())]
    where = ["outside layers"]
    steps = [0]
    query_tokens: list[int] = []  # of each forward
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: where.__setitem__(0, f"layer {i}")))
        hooks.append(layer.register_forward_hook(lambda _m, _a, _o: where.__setitem__(0, "outside layers")))

    def forward_starts(_m: Any, args: Any) -> None:
        steps[0] += 1
        query_tokens.append(int(args[0].input_ids.numel()))

    hooks.append(model.register_forward_pre_hook(forward_starts))
    log: list[tuple[str, str, str]] = []
    params = SamplingParams(max_tokens=8 if draft_tokens else 2, temperature=0.0, ignore_eos=True)
    try:
        with counting_launches(log, lambda: f"step {steps[0]}|{where[0]}"):
            llm.generate([{"prompt_token_ids": list(range(3, 3 + prompt_len))}], params)
    finally:
        for hook in hooks:
            hook.remove()
        llm.shutdown()
    if draft_tokens:  # the first verification: a forward after the prefill with several query tokens
        counted = next((i + 1 for i, n in enumerate(query_tokens) if i and n > 1), None)
        if counted is None:
            raise RuntimeError(f"no verification step: query tokens per forward {query_tokens}")
    else:
        counted = steps[0]  # the decode step: the last forward (the first is the prefill)
    last = f"step {counted}|"
    decode = [(scope[len(last):], kind, name) for scope, kind, name in log if scope.startswith(last)]
    per_layer = {i: summarize([e for e in decode if e[0] == f"layer {i}"]) for i in range(len(layers))}
    moe_counts = {per_layer[i]["total"] for i in moe}
    if len(moe_counts) > 1:
        raise RuntimeError(f"MoE layers launch different numbers of kernels: {sorted(moe_counts)}")
    dense = [i for i in range(len(layers)) if i not in moe]
    return {
        "model": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                          "moe_intermediate_size", "num_attention_heads", "q_lora_rank")},
        "device": device, "interpreted": os.environ.get("TRITON_INTERPRET") == "1", "forward_passes": steps[0],
        "query_tokens": query_tokens[counted - 1],
        "launches_per_moe_layer": per_layer[moe[0]]["total"] if moe else None,
        "moe_layer": per_layer[moe[0]] if moe else None,
        "dense_layer": per_layer[dense[0]] if dense else None,
        "outside_layers": summarize([e for e in decode if e[0] == "outside layers"]),
        "step_total": len(decode),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full-size", action="store_true", help="Moonlight-16B-A3B's own widths (27 layers cut to 3)")
    parser.add_argument("--device", default=None, help="cpu (Triton interpreted) or cuda; default: cuda when present")
    parser.add_argument("--draft-tokens", type=int, default=3,
                        help="also count a verification step of up to this many drafted tokens (n-gram); 0: decode only")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    from benchmarks.gpu_check import MOONLIGHT_CONFIG, TINY_CONFIG

    config = dict(MOONLIGHT_CONFIG if args.full_size else TINY_CONFIG, num_hidden_layers=3)
    result = count_decode_step(config, device)
    verify = count_decode_step(config, device, draft_tokens=args.draft_tokens) if args.draft_tokens else None
    if verify is not None:
        result["verify_step"] = {key: verify[key] for key in ("query_tokens", "launches_per_moe_layer", "moe_layer",
                                                               "dense_layer", "outside_layers", "step_total")}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
