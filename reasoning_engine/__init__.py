"""Reasoning Engine: serve large reasoning models (Kimi K2.5, DeepSeek-V3 and friends) fast, on CPU or GPU."""

from reasoning_engine.outputs import CompletionOutput, RequestOutput
from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.structured.params import StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Import the engine lazily: `import reasoning_engine` stays cheap for the CLI and the parsers."""
    if name == "LLM":
        from reasoning_engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from reasoning_engine.engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'reasoning_engine' has no attribute {name!r}")
