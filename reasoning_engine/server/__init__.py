"""The OpenAI-compatible server: `reasoning_engine.server.app.build_app(engine, ServerConfig)`.

Kept import-free so `reasoning_engine.server.cli` (and `reasoning-engine --help`) loads without fastapi or torch.
"""
