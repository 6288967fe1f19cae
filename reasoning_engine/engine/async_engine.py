"""AsyncLLM: the engine behind the server. One background thread drives every request through LLMEngine.step();
coroutines submit requests and receive their outputs through asyncio queues.

The model's forward pass releases the GIL inside torch, so the server's event loop keeps answering while a step runs.
Requests are validated in the caller (so bad input fails at once with ValueError) and handed to the engine thread,
which alone touches the scheduler and the KV cache.

Media work (decoding, preprocessing, placeholder expansion) runs on the engine's own bounded pool of
`MEDIA_THREADS` threads (`run_media`), never on asyncio's default pool, so it neither waits behind nor delays
unrelated blocking work.

The engine thread also builds the engine (loading, calibration, warm-up), so all of the model's torch work runs in one
thread. OpenMP keeps a team of worker threads per thread that runs parallel regions; with a second team (the loading
thread's) libgomp manages more threads than there are CPUs and stops spinning between regions, and every small op then
pays a thread wake-up (several times slower steps: docs/measurements.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.engine import EngineStats, LLMEngine, PromptType, prompt_cache_salt
from reasoning_engine.engine.arguments import build_engine_config
from reasoning_engine.multimodal.inputs import MediaItem
from reasoning_engine.multimodal.processing import MediaProcessor
from reasoning_engine.outputs import RequestOutput
from reasoning_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
# items decoded and preprocessed at once: with the loader's per-item pixel limits, this bounds their memory
MEDIA_THREADS = max(1, min(4, os.cpu_count() or 1))


class EngineDeadError(RuntimeError):
    """The engine thread failed; requests in flight were ended."""


class AsyncLLM:
    engine: LLMEngine  # set by the engine thread, before the constructor returns

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        config = build_engine_config(model, **engine_kwargs)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.failure: str | None = None  # why the engine died, if it did
        self._dead_callbacks: list[Callable[[], None]] = []
        self.media_pool = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="reasoning-engine-media")
        built: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._build_and_loop, args=(config, built), name="reasoning-engine-loop",
                                        daemon=True)
        self._thread.start()
        engine = built.get()
        if isinstance(engine, BaseException):  # a bad checkpoint or setting fails here, in the caller
            self._thread.join()
            raise engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the engine has died (a step raised, or a rank of a distributed engine failed) and
        every request in flight has been given the error."""
        self._dead_callbacks.append(callback)

    def _died(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        self._fail_streams(EngineDeadError(reason))
        for callback in self._dead_callbacks:
            callback()

    def _rank_failed(self, reason: str) -> None:
        """From the executor's monitor: the engine thread may be stuck in a collective, so answer every stream from
        here (the thread's own failure path, if it gets there, finds nothing left to do)."""
        self._died(f"a rank of the distributed engine failed: {reason}")

    # ---- client side ----
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       session_id: str | None = None, workload: str = "default") -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs as tokens arrive; the last one has finished=True. Cancelling aborts the request;
        `abort(request_id)` ends the stream with a last output whose unfinished samples say finish_reason "abort".
        `session_id` and `workload`, and a prompt dict's `cache_salt`: see LLMEngine.add_request."""
        if self._stopped or self.failure is not None:
            raise EngineDeadError(self.failure or "the engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        cache_salt = prompt_cache_salt(prompt)
        token_ids, media = await self.expand_prompt(prompt)
        self.engine.validate(token_ids, params, media)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (loop, outputs)
        resolved = {"prompt_token_ids": token_ids, "prompt": prompt if isinstance(prompt, str) else None,
                    "cache_salt": cache_salt}
        self._send("add", (request_id, resolved, params, session_id, workload, media))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                while isinstance(item, RequestOutput) and not item.finished and not outputs.empty():
                    item = outputs.get_nowait()  # outputs are cumulative: only the newest matters
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    async def expand_prompt(self, prompt: PromptType) -> tuple[list[int], tuple[MediaItem, ...]]:
        """The token ids `generate` submits for `prompt`: each media placeholder widened to its item's run of tokens
        (preprocessing on the media pool), with the items."""
        _, token_ids = self.engine.tokenize(prompt)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            return await self.run_media(self.engine.expand_media, prompt, token_ids)
        return token_ids, ()

    async def run_media(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the media pool: blocking media work (decoding, preprocessing) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.media_pool, fn, *args)

    @property
    def media_processor(self) -> MediaProcessor | None:
        """The model's image and video preprocessing (None for a text model)."""
        return self.engine.media_processor

    @property
    def supports_media(self) -> bool:
        """Whether prompts may carry images and video (a vision tower and a tokenizer to place them with)."""
        return self.engine.media_processor is not None

    @property
    def media_limits(self) -> dict[str, int]:
        """At most this many items of each kind per prompt (limit_mm_per_prompt)."""
        return dict(self.engine.config.limit_mm_per_prompt)

    @property
    def is_running(self) -> bool:
        """False once the engine thread has stopped (shut down, or died): the server's /health reports it."""
        return self._thread.is_alive() and not self._stopped and self.failure is None

    async def abort(self, request_id: str) -> None:
        """Stop the request and free its KV blocks; its `generate` stream ends with a final output (finish_reason
        "abort"), so no consumer waits for tokens that will never come."""
        self._send("abort", request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def kv_events(self, after: int = 0, replica: int = 0, limit: int = 1000) -> dict[str, Any]:
        """The prefix cache's events (LLMEngine.kv_events; the log takes a lock, so this thread may read it)."""
        return self.engine.kv_events(after, replica, limit)

    def adaptive_snapshot(self) -> dict[str, Any]:
        """The adaptive engine's last snapshot (rebuilt by the engine thread; read here without a lock)."""
        return self.engine.adaptive_snapshot()

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_sync)

    def shutdown_sync(self) -> None:
        """Stop the engine thread, then the other ranks of a distributed engine. After a rank failed the thread may
        be stuck in a collective: it is given 2 s, not 30."""
        if self._stopped:
            return
        self._stopped = True
        self._send("stop", None)
        self._thread.join(timeout=2 if self.failure is not None else 30)
        self.media_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    # ---- engine thread ----
    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _build_and_loop(self, config: EngineConfig, built: queue.SimpleQueue[LLMEngine | BaseException]) -> None:
        """Build the engine here (see the module docstring), hand it (or why it failed) to the constructor, then
        drive it."""
        try:
            engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            built.put(exc)
            return
        self.engine = engine
        engine.runner.executor.on_failure(self._rank_failed)
        built.put(engine)
        self._loop()

    def _loop(self) -> None:
        while True:
            if not self._apply_commands():
                break
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - the thread must survive to end every request cleanly
                logger.exception("engine step failed")
                self._fail_all(EngineDeadError(f"engine step failed: {exc}"))
                if self.engine.runner.executor.failure is not None:  # the ranks cannot step together any more
                    self._died(self.engine.runner.executor.failure)
                    break
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        self._fail_all(EngineDeadError("the engine is shut down"))

    def _apply_commands(self) -> bool:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "abort":
                final = self.engine.abort_request(payload)
                if final is not None:
                    self._deliver(payload, final)
                continue
            request_id, prompt, params, session_id, workload, media = payload
            try:
                self.engine.add_request(request_id, prompt, params, session_id=session_id, workload=workload,
                                        media=media)
            except ValueError as exc:
                self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the client's loop is closed: nobody is listening
            self.engine.abort_request(request_id)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.engine.groups):
            self.engine.abort_request(request_id)
        self._fail_streams(error)

    def _fail_streams(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for request_id, (loop, outputs) in streams:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, error)
            except RuntimeError:  # the client's loop is closed: nobody is listening
                pass
