"""Test helpers: Kimi-format character and byte-level tokenizers, a tiny random checkpoint using the first, and a live
uvicorn server on loopback running in a background thread."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import string
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai

def run_coroutine(coroutine: Any) -> Any:
    """Run a coroutine to its end in a thread and loop of its own: pytest-playwright's sync API keeps an event loop
    running in the main thread once a browser test has run, where `asyncio.run` would refuse."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="test-coroutine")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


# Kimi's chat tokens are special (skipped when decoding with skip_special_tokens); <think> and </think> are plain
# added tokens so they survive decoding, as in the bundled model; hermes' tags are plain added tokens as in Qwen.
KIMI_SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                 "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- elif message.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}\n"
    "{{ message.content }}<|im_end|>"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "<think>{{ message.reasoning_content or '' }}</think>{{ message.content or '' }}"
    "{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
    "{{ call.function.arguments }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- else -%}{{ raise_exception('unknown role ' + message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def save_kimi_tokenizer(folder: Path) -> Any:
    """One token per printable character plus Kimi's chat and tool tokens; returns the loaded tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(string.printable))
    vocab = {tok: i for i, tok in enumerate(["<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _save_with_kimi_chat(tok, folder, unk_token="<unk>")


def save_byte_level_tokenizer(folder: Path) -> Any:
    """A GPT-2-style byte-level BPE without merges (one token per byte, so "—" is three tokens, one of them the lone
    byte 0x80) plus Kimi's chat and tool tokens; returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _save_with_kimi_chat(tok, folder)


def _save_with_kimi_chat(tok: Any, folder: Path, **options: str) -> Any:
    """Wrap a `tokenizers` tokenizer with Kimi's chat tokens and template, save it and load it back."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", **options)
    fast.add_special_tokens({"additional_special_tokens": KIMI_SPECIALS[1:]})
    fast.add_tokens(PLAIN_ADDED)
    fast.chat_template = KIMI_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def save_random_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A 2-layer llama with random weights speaking through the Kimi-format tokenizer: fast, structure-only tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = save_kimi_tokenizer(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


class LiveServer:
    """A real uvicorn server for `app` on 127.0.0.1 (a free port), in a background thread with its own loop."""

    def __init__(self, app: Any, graceful_shutdown_timeout: float = 5.0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=graceful_shutdown_timeout))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def sse_events(response: httpx.Response) -> list[dict[str, Any] | str]:
    """Parsed `data:` payloads of a streamed response, `[DONE]` kept as the string."""
    events: list[dict[str, Any] | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return None


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started that are still there (a server's or an engine's ranks)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


MARKERS = ("<think>", "</think>", "<|tool_call", "<|im_")


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"order": [], "reasoning": "", "content": "", "calls": {}, "finish": None, "usage": None}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        out["usage"] = chunk.usage or out["usage"]
        for choice in chunk.choices:
            reasoning = getattr(choice.delta, "reasoning_content", None)
            if reasoning:
                out["order"].append("reasoning")
                out["reasoning"] += reasoning
            if choice.delta.content:
                out["order"].append("content")
                out["content"] += choice.delta.content
            for call in choice.delta.tool_calls or []:
                slot = out["calls"].setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                slot["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    if "content" in out["order"]:
        assert "reasoning" not in out["order"][out["order"].index("content"):], "thinking after the answer started"
    for piece in (out["reasoning"], out["content"]):
        assert not any(m in piece for m in MARKERS), piece
    return out


def bundled_model_fixtures(model: str | None = None, max_model_len: int = 1024) -> tuple[Any, Any, Any]:
    """Module-scoped `engine` (an AsyncLLM of the bundled model, or of `model`: 128 blocks of 16, 8 sequences),
    `server` (a LiveServer of the app around it) and `client` (an openai client of it) fixtures, for a test module
    to take as `engine, server, client = bundled_model_fixtures()`."""
    import pytest

    from reasoning_engine.server.app import ServerConfig, build_app

    @pytest.fixture(scope="module")
    def engine() -> Iterator[Any]:
        from reasoning_engine.engine.async_engine import AsyncLLM

        llm = AsyncLLM(model=model, device="cpu", max_model_len=max_model_len, kv_cache_blocks=128, block_size=16,
                       max_num_seqs=8)
        yield llm
        llm.shutdown_sync()

    @pytest.fixture(scope="module")
    def server(engine: Any) -> Iterator[LiveServer]:
        with LiveServer(build_app(engine, ServerConfig(shutdown_engine=False))) as live:
            yield live

    @pytest.fixture(scope="module")
    def client(server: LiveServer) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    return engine, server, client



def tiny_chat_engine(source: Path, folder: Path, save_tokenizer: Callable[[Path], int]) -> Any:
    """An AsyncLLM (CPU, float32, 4096 positions) over a copy in `folder` of the tiny random checkpoint `source`,
    serving chats through the one-token-per-character tokenizer `save_tokenizer` writes there (it returns the
    tokenizer's end-of-turn id): that id becomes the checkpoint's (its own is a character here), and positions are
    enough for a chat template's tools block."""
    from reasoning_engine.engine.async_engine import AsyncLLM

    shutil.copytree(source, folder)
    eos_token_id = save_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(eos_token_id=eos_token_id, max_position_embeddings=4096)
    (folder / "config.json").write_text(json.dumps(config))
    generation = folder / "generation_config.json"
    if generation.is_file():
        generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": eos_token_id}))
    return AsyncLLM(model=str(folder), device="cpu", dtype="float32", max_model_len=4096, kv_cache_blocks=512,
                    block_size=16, max_num_seqs=4)
