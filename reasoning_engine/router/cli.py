"""`reasoning-engine router`: one OpenAI-compatible endpoint over running replicas (`--replica URL`, repeated) or
over replicas it starts itself (`--local-replicas N -- MODEL SERVE-FLAGS`, each a `reasoning-engine serve` on a
free port, stopped with the router). Heavy imports happen inside the command."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from reasoning_engine.router.policy import POLICIES


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser(
        "router", help="Route requests over several server replicas behind one endpoint.",
        description="One OpenAI-compatible endpoint over several replicas: requests go where their prompt's prefix "
                    "is cached (cache-aware, default), to the least-loaded replica, or round-robin; a replica that "
                    "fails is marked down and requests that had not started answering are retried elsewhere.",
        epilog="example: reasoning-engine router --local-replicas 2 -- MODEL --max-model-len 4096")
    router.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a running replica's base URL, e.g. http://10.0.0.5:8000 (repeat for each)")
    router.add_argument("--local-replicas", type=int, default=0, metavar="N",
                        help="start N `reasoning-engine serve` replicas here, with the arguments after `--`")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--policy", choices=POLICIES, default="cache-aware")
    router.add_argument("--overlap-weight", type=float, default=1.0,
                        help="cache-aware: the weight of a replica's prompt blocks to prefill against its active "
                             "blocks (higher: more cache reuse, lower: more even load)")
    router.add_argument("--balance-abs-threshold", type=int, default=64,
                        help="cache-aware: route to the least-loaded replica once the busiest has more than this "
                             "many requests over the idlest ...")
    router.add_argument("--balance-rel-threshold", type=float, default=1.5,
                        help="... and more than this many times the idlest's")
    router.add_argument("--block-chars", type=int, default=None,
                        help="characters of prompt per hashed block (default: 64, about 16 tokens)")
    router.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a replica")
    router.add_argument("--read-timeout", type=float, default=600.0,
                        help="seconds a replica may stay silent (before its answer, or between stream events)")
    router.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    router.add_argument("--max-attempts", type=int, default=3, help="replicas one request may be tried on")
    router.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    router.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="after `--`: MODEL and the `serve` flags of each local replica")
    router.set_defaults(func=router_command)


def router_command(args: argparse.Namespace) -> int:
    import uvicorn

    from reasoning_engine.router.local import start_replicas, stop_replicas
    from reasoning_engine.router.policy import RoutingConfig
    from reasoning_engine.router.prefix import DEFAULT_BLOCK_CHARS
    from reasoning_engine.router.proxy import ProxyConfig, build_router_app

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if args.local_replicas < 0 or (args.local_replicas == 0 and not args.replica):
        print("error: give --replica URL (repeatable) or --local-replicas N", file=sys.stderr)
        return 2
    if serve_args and not args.local_replicas:
        print("error: serve arguments after `--` need --local-replicas N", file=sys.stderr)
        return 2
    try:
        routing = RoutingConfig(args.policy, args.overlap_weight, args.balance_abs_threshold,
                                args.balance_rel_threshold)
        proxy = ProxyConfig(connect_timeout=args.connect_timeout, read_timeout=args.read_timeout,
                            health_interval=args.health_interval, max_attempts=args.max_attempts,
                            block_chars=args.block_chars or DEFAULT_BLOCK_CHARS)
        local = start_replicas(args.local_replicas, serve_args) if args.local_replicas else []
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # uvicorn re-raises the SIGTERM it caught once it has shut down; a handler that raises lets `finally` stop the
    # local replicas instead of the default action ending the process first
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        urls = [*args.replica, *(replica.url for replica in local)]
        app = build_router_app(urls, routing, proxy)
        print(f"Routing ({args.policy}) over {len(urls)} replicas at http://{args.host}:{args.port}/v1: "
              f"{', '.join(urls)}", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        stop_replicas(local)
    return 0


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)
