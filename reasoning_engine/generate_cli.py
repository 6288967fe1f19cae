"""`reasoning-engine generate`: one prompt through the offline engine, printed as it finishes."""

from __future__ import annotations

import argparse


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate a completion for one prompt (offline, no server)")
    parser.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the bundled tiny model)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    parser.add_argument("--no-thinking", action="store_true", help="with --chat: render the template with thinking off")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: from the checkpoint)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: best available)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode batches")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
                            skip_special_tokens=False if args.chat else True)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params,
                       chat_template_kwargs={"thinking": not args.no_thinking})[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0
