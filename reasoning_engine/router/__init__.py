"""Many replicas of the server behind one OpenAI-compatible endpoint: a routing policy (policy.py) over what the
router remembers of each replica's prefix cache (prefix.py), an HTTP proxy that forwards and streams unchanged
(proxy.py), local replica processes (local.py) and the `reasoning-engine router` command (cli.py). The router
speaks HTTP to the replicas and never imports the engine."""
