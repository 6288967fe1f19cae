"""`reasoning-engine serve` and `reasoning-engine chat`. Heavy imports (torch, fastapi, uvicorn) happen inside the
command functions so `reasoning-engine --help` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from reasoning_engine.server.formats.registry import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES

API_KEY_ENV = "REASONING_ENGINE_API_KEY"
MEDIA_MAX_BYTES = 20 * 1024 * 1024
MEDIA_FETCH_TIMEOUT_S = 10.0
MEDIA_REQUEST_TIMEOUT_S = 30.0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """The `serve` and `chat` commands."""
    serve = subparsers.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.",
                                  description="Serve MODEL (a checkpoint folder; default: the bundled tiny reasoning "
                                              "model) over an OpenAI-compatible API.")
    serve.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the bundled tiny model)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1, local only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")
    serve.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use")
    serve.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default="auto")
    serve.add_argument("--tool-call-parser", choices=TOOL_PARSER_CHOICES, default="auto")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, used instead of the model's")
    serve.add_argument("--max-thinking-tokens", type=int, default=None,
                       help="default thinking budget for requests that set none")
    serve.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "suffix", "num_speculative_tokens": 4}\'')
    serve.add_argument("--speculative-state-dir", default=None,
                       help="folder where the speculative proposer keeps its state across restarts (default: "
                            "--state-dir)")
    _add_engine_flags(serve)
    _add_request_flags(serve)
    serve.set_defaults(func=serve_command)
    _add_chat_command(subparsers)


def _add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """`serve`'s adaptive, engine and parallel settings."""
    adaptive = serve.add_argument_group("adaptive", "the engine measures its step costs and its workload and tunes "
                                        "speculation, batching and KV retention from them (GET /v1/engine/adaptive)")
    adaptive.add_argument("--no-adaptive", action="store_true",
                          help="static behaviour: draft lengths that double and halve, the configured token budget, "
                               "LRU eviction only")
    adaptive.add_argument("--state-dir", default=None,
                          help="folder for everything the engine learns (cost model, acceptance statistics, agents' "
                               "return gaps, the suffix store), reloaded at the next start")
    adaptive.add_argument("--target-itl-ms", type=float, default=None,
                          help="keep running decodes' inter-token latency under this: prefill chunks are sized to fit")
    adaptive.add_argument("--target-ttft-ms", type=float, default=None,
                          help="let a waiting prompt through in bigger chunks when its first token is at risk")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    engine.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    engine.add_argument("--kernel-backend", default=None, choices=("torch", "triton"),
                        help="kernels: triton (default on CUDA) or the torch reference path (default on CPU)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly: no CUDA graphs for decode batches (captured by default on CUDA "
                             "with the triton kernels)")
    engine.add_argument("--compile-decode", action="store_true",
                        help="torch.compile decode steps of up to 4 sequences (CPU): faster tokens, compiled at start")
    engine.add_argument("--kv-cache-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3"),
                        help="auto: the model's dtype; fp8 (fp8_e4m3): K/V and MLA's latent in float8 e4m3 with a scale "
                             "per token (and head), about 1.9x the tokens in the same memory")
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--no-enable-prefix-caching", action="store_true", help="turn the prefix cache off")
    engine.add_argument("--kv-offload-size", default=None, metavar="BYTES",
                        help="host memory per rank ('8GiB', '512MB') that keeps prefix-cache blocks evicted from the "
                             "device; a later hit copies them back instead of recomputing (default: off)")
    engine.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                        help="folder where blocks evicted from the host tier are kept, one checksummed file per block, "
                             "reused after a restart (needs --kv-offload-size)")
    engine.add_argument("--kv-offload-dir-size", default=None, metavar="BYTES",
                        help="most bytes per rank the folder holds, least recently used out first (default: 16GiB)")
    parallel = serve.add_argument_group("parallel", "spread the model over several processes, GPUs or nodes "
                                        "(docs/ARCHITECTURE.md: when to pick TP, EP or DP + EP)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                          help="split attention, dense layers and the vocabulary over this many ranks")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                          help="replicas that each schedule their own requests and keep their own KV cache; their "
                               "attention runs data-parallel, the MoE layers expert-parallel over all ranks (needs "
                               "--enable-expert-parallel)")
    parallel.add_argument("--enable-expert-parallel", action="store_true",
                          help="partition the routed experts over all ranks instead of splitting each expert")
    parallel.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                          help="start the other ranks as child processes (mp, default) or as Ray actors in a "
                               "placement group of the running Ray cluster (ray)")
    parallel.add_argument("--nnodes", type=int, default=_env_int("NNODES"),
                          help="nodes the ranks span; run this command on each (default: $NNODES, or 1)")
    parallel.add_argument("--node-rank", type=int, default=_env_int("NODE_RANK", "GROUP_RANK"),
                          help="this node's index; node 0 serves HTTP, the others only run their ranks "
                               "(default: $NODE_RANK or torchrun's $GROUP_RANK, or 0)")
    parallel.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                          help="node 0's address, where the ranks meet (default: $MASTER_ADDR, or 127.0.0.1)")
    parallel.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"),
                          help="the port there (default: $MASTER_PORT; one node: a free port)")


def _add_request_flags(serve: argparse.ArgumentParser) -> None:
    """`serve`'s limits on what requests bring (media, stored responses, HTTP bodies) and its HTTP settings."""
    media = serve.add_argument_group("media", "images and videos in chat messages, for models with a vision tower "
                                     "(Kimi K2.5); data: URLs are always accepted, within --max-body-bytes")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="hosts (and their subdomains) that http(s) image and video URLs may name (default: none)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="folder that file:// image and video URLs may point into (default: none)")
    media.add_argument("--limit-mm-per-prompt", type=parse_media_limits_flag, default=None, metavar="LIMITS",
                       help='most images and videos one request may carry: \'{"image": 2, "video": 1}\' or '
                            "image=2,video=1 (default: 16 images, 2 videos)")
    media.add_argument("--media-max-bytes", type=int, default=MEDIA_MAX_BYTES,
                       help=f"largest image or video file (default: {MEDIA_MAX_BYTES >> 20} MiB)")
    media.add_argument("--max-image-pixels", type=_positive(int), default=None, metavar="PIXELS",
                       help="largest image, width x height, checked from its header before decoding (default: 16x "
                            "the model's largest input, at least 16 megapixels)")
    media.add_argument("--max-video-pixels", type=_positive(int), default=None, metavar="PIXELS",
                       help="most pixels one video may decode, frames x width x height: every frame of an animated "
                            "image, the sampled frames of a video file (default: 4x --max-image-pixels' default)")
    media.add_argument("--media-fetch-timeout", type=_positive(float), default=MEDIA_FETCH_TIMEOUT_S,
                       metavar="SECONDS", help="time allowed to fetch one http(s) media URL, all of it: redirects, "
                                               f"headers and body (default: {MEDIA_FETCH_TIMEOUT_S:g})")
    media.add_argument("--media-request-timeout", type=_positive(float), default=MEDIA_REQUEST_TIMEOUT_S,
                       metavar="SECONDS", help="time allowed for all of one request's media: fetching, decoding and "
                                               f"preprocessing (default: {MEDIA_REQUEST_TIMEOUT_S:g})")
    responses = serve.add_argument_group("responses", "stored responses of /v1/responses (store: true), which "
                                         "previous_response_id continues; kept in memory, least recently used first out")
    responses.add_argument("--max-stored-responses", type=_positive(int), default=None, metavar="N",
                           help="most responses kept (default: 1024)")
    responses.add_argument("--stored-response-ttl", type=_positive(float), default=None, metavar="SECONDS",
                           help="how long after it was stored a response may be continued (default: 3600)")
    http = serve.add_argument_group("http")
    http.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies get 413")
    http.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests may finish after SIGTERM before they are aborted")
    http.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _add_chat_command(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser("chat", help="Chat with a running server in the terminal.",
                                 description="A terminal client: the thinking streams dimmed, the answer plain.")
    chat.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    chat.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    chat.add_argument("--model", default=None, help="default: the first model the server lists")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--no-thinking", action="store_true", help="ask the model to answer without thinking")
    chat.add_argument("--max-thinking-tokens", type=int, default=None)
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=None)
    chat.add_argument("--hide-thinking", action="store_true", help="do not print the thinking")
    chat.add_argument("-m", "--message", action="append", default=None,
                      help="send this message and exit (repeat for several turns)")
    chat.set_defaults(func=chat_command)


def parse_media_limits_flag(text: str) -> dict[str, Any]:
    """`--limit-mm-per-prompt` in vLLM's JSON form or as `image=2,video=1`; the kinds and counts are checked where
    the engine config is built."""
    try:
        if text.lstrip().startswith("{"):
            limits = json.loads(text)
        else:
            limits = {}
            for item in filter(None, (piece.strip() for piece in text.split(","))):
                kind, sep, count = item.partition("=")
                if not sep:
                    raise ValueError(f"{item!r} is not KIND=COUNT")
                limits[kind.strip()] = int(count)
    except ValueError as exc:  # json.JSONDecodeError included
        raise argparse.ArgumentTypeError(f"expected '{{\"image\": 2}}' or image=2,video=1: {exc}") from exc
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError("expected a JSON object such as '{\"image\": 2}'")
    return limits


def _positive(kind: type[int] | type[float]) -> Any:
    """An argparse type: a number > 0 (argparse names the flag in its error)."""
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _env_int(*names: str) -> int | None:
    """The first of these environment variables that is set (torchrun's names, for multi-node launches)."""
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only what the user set, so the engine's own defaults apply otherwise."""
    kwargs: dict[str, Any] = {
        "dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
        "kv_cache_blocks": args.kv_cache_blocks, "kv_cache_dtype": args.kv_cache_dtype, "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "kernel_backend": args.kernel_backend,
        "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend, "nnodes": args.nnodes,
        "node_rank": args.node_rank, "master_addr": args.master_addr, "master_port": args.master_port,
        "state_dir": args.state_dir, "target_itl_ms": args.target_itl_ms, "target_ttft_ms": args.target_ttft_ms,
        "limit_mm_per_prompt": args.limit_mm_per_prompt, "kv_offload_size": args.kv_offload_size,
        "kv_offload_dir": args.kv_offload_dir, "kv_offload_dir_size": args.kv_offload_dir_size,
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if args.no_enable_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.compile_decode:
        kwargs["compile_decode"] = True
    if args.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if args.no_adaptive:
        kwargs["adaptive"] = False
    if args.speculative_config:
        spec = json.loads(args.speculative_config)
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        kwargs["speculative_config"] = spec
    if args.speculative_state_dir:
        if not args.speculative_config:
            raise ValueError("--speculative-state-dir needs --speculative-config")
        kwargs["speculative_state_dir"] = args.speculative_state_dir
    return kwargs


def _bundled_model_missing() -> str | None:
    """The message to print when no MODEL was given and the bundled model's files are absent."""
    try:
        from reasoning_engine.config import BUNDLED_MODEL_DIR
    except ImportError:
        return "the bundled tiny model is not part of this installation; pass a checkpoint folder: serve MODEL"
    if not (Path(BUNDLED_MODEL_DIR) / "config.json").is_file():
        return (f"the bundled tiny model's files are missing from {BUNDLED_MODEL_DIR}; regenerate them with "
                "`python -m reasoning_engine.tiny.train`, or pass a checkpoint folder: serve MODEL")
    return None


def serve_command(args: argparse.Namespace) -> int:
    if args.model is None:
        missing = _bundled_model_missing()
        if missing:
            print(f"error: {missing}", file=sys.stderr)
            return 2
    elif not Path(args.model).is_dir():
        print(f"error: model folder not found: {args.model}", file=sys.stderr)
        return 2
    from reasoning_engine.server.chat_template import read_chat_template

    try:
        engine_kwargs = _engine_kwargs(args)
        chat_template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if engine_kwargs.get("node_rank", 0) > 0:
        return _serve_node(engine_kwargs)

    import uvicorn

    from reasoning_engine.engine.async_engine import AsyncLLM
    from reasoning_engine.server.app import ServerConfig, build_app

    try:
        engine = AsyncLLM(model=args.model, **engine_kwargs)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = build_app(engine, ServerConfig(
        served_model_names=args.served_model_name, api_key=args.api_key, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, max_thinking_tokens=args.max_thinking_tokens,
        max_body_bytes=args.max_body_bytes, allowed_media_domains=args.allowed_media_domains,
        allowed_local_media_path=args.allowed_local_media_path, media_max_bytes=args.media_max_bytes,
        media_fetch_timeout=args.media_fetch_timeout, max_image_pixels=args.max_image_pixels,
        max_video_pixels=args.max_video_pixels, media_request_timeout=args.media_request_timeout,
        chat_template=chat_template,
        **{name: value for name, value in (("max_stored_responses", args.max_stored_responses),
                                           ("stored_response_ttl_s", args.stored_response_ttl)) if value is not None}))
    serving = app.state.serving
    print(f"Serving {', '.join(serving.model_names)} at http://{args.host}:{args.port}/v1, playground at "
          f"http://{args.host}:{args.port}/ "
          f"(context {serving.max_model_len}, reasoning parser {serving.reasoning_parser or 'none'}, "
          f"tool-call parser {serving.tool_parser or 'none'}, API key {'required' if args.api_key else 'off'})",
          flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout)
    server = uvicorn.Server(config)
    engine.on_dead(lambda: setattr(server, "should_exit", True))  # a failed rank: stop serving, exit non-zero
    server.run()
    if engine.failure is not None:
        print(f"error: the engine stopped: {engine.failure}", file=sys.stderr)
        return 1
    return 0


def _serve_node(engine_kwargs: dict[str, Any]) -> int:
    """A node other than node 0: run this node's ranks (they take the engine config from node 0) until they stop."""
    from reasoning_engine.config import ParallelConfig
    from reasoning_engine.engine.distributed import run_node

    fields = ("tensor_parallel_size", "data_parallel_size", "nnodes", "node_rank", "master_addr", "master_port")
    config = ParallelConfig(**{k: engine_kwargs[k] for k in fields if k in engine_kwargs})
    if config.master_port is None or config.nnodes < 2 or config.node_rank >= config.nnodes:
        print("error: a node other than node 0 needs --nnodes > 1, --node-rank < nnodes, --master-addr and "
              "--master-port (node 0's)", file=sys.stderr)
        return 2
    print(f"node {config.node_rank} of {config.nnodes}: running ranks {config.node_rank * config.ranks_per_node} to "
          f"{(config.node_rank + 1) * config.ranks_per_node - 1}, meeting at {config.master_addr}:{config.master_port}",
          flush=True)
    return run_node(config)


def chat_command(args: argparse.Namespace) -> int:
    from reasoning_engine.server.chat_client import run_chat

    return run_chat(args)


def main(argv: list[str] | None = None) -> int:
    """`python -m reasoning_engine.server.cli serve|chat ...`, the same commands without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="reasoning-engine")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
