"""Starting the model's workers: the one in this process, or one per rank (`distributed.py`)."""

from __future__ import annotations

from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.model_runner import Executor
from reasoning_engine.engine.worker import ModelWorker


def start_executor(config: EngineConfig) -> Executor:
    """A ready executor for this engine: every rank's caches allocated, its decode graphs captured or compiled."""
    if config.parallel.world_size > 1:
        from reasoning_engine.engine.distributed import DistributedExecutor

        return DistributedExecutor(config)
    worker = ModelWorker(config)
    worker.init_cache(worker.available_blocks())
    return worker
