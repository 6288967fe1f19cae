"""Tensor, expert and data parallelism on CPU (gloo): N ranks give one process's tokens.

Every case runs batched mixed-length prompts on a KV cache small enough to force preemption, against the same
checkpoint in one process: greedy tokens equal, logprobs within 1e-4 relative. Ranks start as child processes (mp),
as Ray actors of a local Ray cluster, or as two "nodes" on loopback. The ranks' lifetime: they live as long as the
driver's process (not the thread that started them), go when an LLM is dropped, and stop in order at shutdown.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.config import ParallelConfig, load_model_config
from reasoning_engine.engine.async_engine import AsyncLLM
from reasoning_engine.engine.distributed import _in_lasting_thread, free_port

from models.checkpoints import VOCAB, TinyCheckpoint, prompts
from server.helpers import alive, child_pids, wait_for

from .test_hybrid import TreeDrafts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
# 17 blocks of 4 tokens (the least a 64-token context needs): the eight prompts do not fit at once; steps of at most
# 16 tokens: the longer prompts are prefilled in chunks
TIGHT = dict(dtype="float32", device="cpu", block_size=4, kv_cache_blocks=17, max_model_len=64, max_num_batched_tokens=16)
ROOT = Path(__file__).resolve().parents[2]


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts(VOCAB) + prompts(VOCAB, seed=1)]


def _assert_same(outs, reference) -> None:
    for out, ref in zip(outs, reference, strict=True):
        got, want = out.outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids
        for entry, ref_entry, token in zip(got.logprobs, want.logprobs, got.token_ids):
            assert entry[token].logprob == pytest.approx(ref_entry[token].logprob, rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def one_process(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> Callable[[str], tuple[Path, list]]:
    """Per variant: its folder and the one-process outputs of the prompts (computed once)."""
    done: dict[str, tuple[Path, list]] = {}

    def get(variant: str) -> tuple[Path, list]:
        if variant not in done:
            ckpt = tiny_checkpoint(variant)
            done[variant] = ckpt.path, LLM(ckpt.path, **TIGHT).generate(_prompts(), GREEDY)
        return done[variant]

    return get


CASES = [
    # variant, tensor_parallel_size, enable_expert_parallel, data_parallel_size
    ("llama", 2, False, 1),
    ("qwen3_moe", 2, False, 1),
    ("qwen3_moe", 2, True, 1),
    ("deepseek_v3", 2, False, 1),
    ("deepseek_v3", 4, False, 1),
    ("deepseek_v2", 2, False, 1),  # no query LoRA: this rank's q_proj rows and the whole kv_a in one fused projection
    ("deepseek_v3", 2, True, 1),
    ("deepseek_v3", 4, True, 1),
    ("deepseek_v3", 1, True, 2),
    ("deepseek_v3", 2, True, 2),
    ("kimi_k25_int4", 2, True, 1),
    ("kimi_k25_int4", 1, True, 2),
    ("deepseek_v3_fp8", 2, True, 1),
    ("minimax_m2", 2, False, 1),  # q/k norms over all heads: the sum of squares is all-reduced over the ranks
    ("minimax_m2", 2, True, 1),
    ("minimax_m2_fp8", 2, True, 1),
    ("minimax_m2", 1, True, 2),
    ("glm4_moe", 2, False, 1),  # q/k/v biases (no output bias), partial rotary, shared experts split like a dense MLP
    ("glm4_moe_as_saved", 2, True, 1),
    ("glm4_moe_fp8", 2, False, 1),  # per-channel FP8 experts packed: gate/up split by rows with their scales, down
    ("glm4_moe_fp8", 2, True, 1),  # by columns with every rank holding all of its per-row scales
    ("gpt_oss", 2, False, 1),  # sinks split with the heads, interleaved gate/up rows split in pairs, one down bias
    ("gpt_oss_mxfp4", 2, True, 1),  # packed MXFP4 experts partitioned over the ranks
    ("gpt_oss", 1, True, 2),  # a block pool with full and sliding-window cache groups per replica
    # hybrid: each rank keeps its linear-attention heads and their states; Qwen3-Next's projections split in whole
    # key-head groups, Qwen3.5's q, k and v blocks each split; one state cache per data-parallel replica
    ("qwen3_next", 2, False, 1),
    ("qwen3_next", 1, True, 2),
    ("qwen3_5", 2, False, 1),
    ("kimi_linear", 2, False, 1),  # KDA heads split like the value heads; NoPE MLA and DeepSeek-V3's MoE as deepseek_v3
]


@pytest.mark.slow
@pytest.mark.parametrize("variant,tp,ep,dp", CASES, ids=[f"{v}-tp{t}{'-ep' if e else ''}-dp{d}" for v, t, e, d in CASES])
def test_ranks_give_one_process_tokens(one_process, variant: str, tp: int, ep: bool, dp: int) -> None:
    path, reference = one_process(variant)
    with LLM(path, tensor_parallel_size=tp, enable_expert_parallel=ep, data_parallel_size=dp, **TIGHT) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        engine = llm.engine
        assert engine.num_preemptions > 0
        assert all(s.blocks.num_free_blocks == s.blocks.num_blocks for s in engine.schedulers)
        assert all(len(s.states.free) + s.states.num_snapshots == s.states.num_slots
                   for s in engine.schedulers if s.states is not None)  # every live state slot given back
        if dp > 1:
            assert all(s.blocks.prefix_queries > 0 for s in engine.schedulers)  # both replicas served requests
    _assert_same(outs, reference)


@pytest.mark.slow
def test_data_parallel_requests_follow_their_cached_prefix(tiny_checkpoint) -> None:
    """A prompt goes to the replica holding most of it in cache, even when that replica is the busier one; without
    a hit, to the least loaded. The cache is looked up under the prompt's cache_salt: the same prompt under another
    salt has no hit anywhere."""
    path = tiny_checkpoint("deepseek_v3").path
    first, other = prompts(VOCAB, seed=2)[3], prompts(VOCAB, seed=3)[3]  # 23 tokens each
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(path, data_parallel_size=2, enable_expert_parallel=True, **TIGHT) as llm:
        engine = llm.engine
        llm.generate([{"prompt_token_ids": first}], GREEDY)  # both idle: replica 0, which now caches its blocks
        busy = engine.add_request(None, {"prompt_token_ids": other}, long)  # no hit anywhere: a tie, replica 0
        stranger = engine.add_request(None, {"prompt_token_ids": first + [7, 8, 9], "cache_salt": "tenant-b"},
                                      long)  # no hit under its salt: the least loaded, replica 1
        follow_up = engine.add_request(None, {"prompt_token_ids": first + [7, 8, 9]}, GREEDY)
        assert [engine.groups[r][0].replica for r in (busy, stranger, follow_up)] == [0, 1, 0]
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert outputs[follow_up].num_cached_tokens == 20  # five full blocks of the first turn's prompt
    assert outputs[stranger].num_cached_tokens == 0


@pytest.fixture(scope="module")
def bundled_reference() -> tuple[list, list]:
    """The bundled model's one-process answers to six questions (its MTP layer drafts well, so speculation is
    exercised for real)."""
    questions = ["What is 347 + 589?", "Sort these numbers: 42, 7, 19, 88", "How many r's are in strawberry?",
                 "What is 23 * 7?", "Which is larger, 71 or 17?", "What is 905 - 388?"]
    messages = [[{"role": "user", "content": q}] for q in questions]
    return messages, LLM(**BUNDLED).chat(messages, BUNDLED_PARAMS)


BUNDLED = dict(dtype="float32", device="cpu", block_size=8, kv_cache_blocks=32, max_model_len=256)
BUNDLED_PARAMS = SamplingParams(temperature=0.0, max_tokens=100)


@pytest.mark.slow
@pytest.mark.parametrize("method,parallel", [
    ("mtp", dict(tensor_parallel_size=2)),
    ("mtp", dict(data_parallel_size=2, enable_expert_parallel=True)),
    ("suffix", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("ngram", dict(data_parallel_size=2, enable_expert_parallel=True)),
])
def test_speculative_decoding_under_parallelism(bundled_reference, method: str, parallel: dict) -> None:
    messages, reference = bundled_reference
    spec = {"method": method, "num_speculative_tokens": 3}
    with LLM(speculative_config=spec, adaptive=False, **parallel, **BUNDLED) as llm:  # static lengths: drafts every step
        outs = llm.chat(messages, BUNDLED_PARAMS)
        stats = llm.engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert stats.spec_decode["accepted_tokens"] > 20
    assert stats.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "dp2-ep"])
def test_seeded_samples_thinking_budget_and_logprobs_under_parallelism(bundled_reference, parallel: dict) -> None:
    """n = 2 seeded samples with a thinking budget and logprobs: the driver samples from the gathered logits, so the
    samples are those of one process (preempted ones included)."""
    messages = bundled_reference[0][:4]
    params = [SamplingParams(temperature=0.8, n=2, seed=seed, max_tokens=80, thinking_token_budget=24, logprobs=2)
              for seed in range(len(messages))]
    reference = LLM(**BUNDLED).chat(messages, params)
    with LLM(**parallel, **BUNDLED) as llm:
        outs = llm.chat(messages, params)
        assert llm.engine.num_preemptions > 0
    for out, ref in zip(outs, reference):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
        assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([o.cumulative_logprob for o in ref.outputs],
                                                                           rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("variant,ep", [("deepseek_v3", True), ("qwen3_next", False)])
def test_each_rank_holds_and_reads_only_its_share(tiny_checkpoint, variant: str, ep: bool) -> None:
    """TP 2 (with the experts EP 2, or split too): each rank's weights are the replicated parts plus half of the
    rest, and loading read about that much from the files (slices, not whole tensors; a hybrid model's conv weights
    in three, its q, k and v channels)."""
    path = tiny_checkpoint(variant).path
    single = LLM(path, **TIGHT)
    whole = single.engine.runner.executor.gather("memory_report")[0]
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=ep, **TIGHT) as llm:
        reports = llm.engine.runner.executor.gather("memory_report")
        shard = _tensors(llm.engine.model)
    tensors = _tensors(single.engine.model)
    replicated = sum(_nbytes(t) for name, t in tensors.items() if shard[name].shape == t.shape)
    split = sum(_nbytes(t) for name, t in tensors.items() if shard[name].shape != t.shape)
    assert replicated + split == whole["weight_bytes"]
    assert split > replicated  # most of the model is split
    for report in reports:
        assert report["weight_bytes"] == pytest.approx(replicated + split / 2, rel=0.01)
        assert report["checkpoint_bytes_read"] <= 1.01 * report["weight_bytes"]
        assert report["checkpoint_bytes_read"] < 0.75 * whole["checkpoint_bytes_read"]


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (linear layers packed for the CPU keep their weight as a buffer)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 must divide num_attention_heads \(4\)"),
    (dict(tensor_parallel_size=2, data_parallel_size=2), "data_parallel_size > 1 .* needs enable_expert_parallel"),
    (dict(tensor_parallel_size=3, enable_expert_parallel=True), "tensor_parallel_size=3 must divide"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="slurm"), "distributed_executor_backend must be one of"),
    (dict(tensor_parallel_size=2, nnodes=2), "several nodes need master_port"),
    (dict(tensor_parallel_size=2, device="cuda"), "2 ranks per node, but this node has 0 CUDA devices"),
])
def test_bad_parallel_settings_fail_at_start_naming_the_option(tiny_checkpoint, kwargs: dict, match: str) -> None:
    if kwargs.get("device") == "cuda" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")  # only reachable on a GPU machine, where the check passes
    path = tiny_checkpoint("deepseek_v3").path
    with pytest.raises(ValueError, match=match):
        LLM(path, **{**TIGHT, **kwargs})


@pytest.mark.slow
def test_hybrid_draft_trees_under_tensor_parallelism(tiny_checkpoint) -> None:
    """Draft trees (in n-gram's place, drafts that know the answer: some accepted whole, some in part, never the
    first branch) verified on two ranks, each holding half of every linear-attention layer's heads with their live
    and per-node scratch states, the accepted node's committed, beside preemption: one process's plain tokens."""
    path = tiny_checkpoint("qwen3_next").path
    requests = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = [list(r.outputs[0].token_ids) for r in LLM(path, **TIGHT).generate(requests, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 8}
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, adaptive=False, **TIGHT) as llm:
        llm.engine.spec.proposer = TreeDrafts([r["prompt_token_ids"] + ref for r, ref in zip(requests, reference)])
        outs = llm.generate(requests, params)
        stats = llm.engine.spec.stats
        assert llm.engine.num_preemptions > 0
        layer = llm.engine.model.linear_layers()[0]  # rank 0's: one key head, two value heads of 16 channels
        assert layer.conv_state.shape[1] == 16 + 16 + 2 * 16 and layer.recurrent_state.shape[1:] == (2, 16, 16)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_linear_attention_heads_must_split_evenly(tiny_checkpoint, tmp_path: Path) -> None:
    """Attention heads that split over 2 ranks but one linear-attention key head: the error names the field."""
    raw = json.loads((tiny_checkpoint("qwen3_next").path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "linear_num_key_heads": 1}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide linear_num_key_heads \(1\)"):
        ParallelConfig(tensor_parallel_size=2).check(load_model_config(tmp_path), torch.device("cpu"))


def test_experts_must_split_evenly_over_the_ranks(tiny_checkpoint) -> None:
    path = tiny_checkpoint("deepseek_v3_fp8").path  # moe_intermediate_size 160: no whole 128-channel blocks per rank
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(160\) into whole quantization blocks of 128"):
        LLM(path, tensor_parallel_size=2, **TIGHT)
    with pytest.raises(ValueError, match=r"all 3 ranks .* must divide n_routed_experts \(8\)"):
        LLM(path, data_parallel_size=3, enable_expert_parallel=True, **TIGHT)


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A one-node Ray cluster on loopback, started as `ray start` would be on each node of a real one (without
    Ray's token authentication, which a loopback-only test cluster does not need)."""
    port = free_port()
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    env = dict(os.environ)
    subprocess.run([*ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env, capture_output=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        import ray as ray_module

        ray_module.shutdown()
        gc.collect()  # a Ray handle the engine kept and freed only now would end this process (Ray's core worker)
        subprocess.run([*ray, "stop", "--force"], env=env, capture_output=True)


@pytest.mark.slow
def test_ray_executor_places_the_ranks_in_a_placement_group(one_process, ray_cluster: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path, reference = one_process("deepseek_v3")
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="ray",
             **TIGHT) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        import ray

        assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2
    _assert_same(outs, reference)
    deadline = time.monotonic() + 20  # the placement group is removed: its CPU goes back to the cluster
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


@pytest.mark.slow
def test_two_nodes_on_loopback(one_process) -> None:
    """`serve --nnodes 2 --node-rank 1` runs the second node's rank; node 0 is this process's engine."""
    path, reference = one_process("deepseek_v3")
    port = free_port()
    node = subprocess.Popen([sys.executable, "-m", "reasoning_engine.cli", "serve", "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "--tensor-parallel-size", "2"],
                            cwd=ROOT)
    try:
        with LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                 **TIGHT) as llm:
            outs = llm.generate(_prompts(), GREEDY)
        assert node.wait(timeout=30) == 0
    finally:
        node.kill()
    _assert_same(outs, reference)


def _rank_pids(driver: int) -> list[int]:
    """The rank processes `driver` started."""
    return [pid for pid in child_pids(driver)
            if b"reasoning_engine.engine.distributed" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _distributed_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "reasoning_engine.engine.distributed" and r.levelno >= logging.WARNING]


@pytest.fixture
def no_rank_left() -> Iterator[None]:
    """Whatever the test did, or failed to do: no rank of this process outlives it, nor its process group."""
    yield
    leftovers = [pid for pid in _rank_pids(os.getpid()) if alive(pid)]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    if dist.is_initialized():
        dist.destroy_process_group()
    assert not leftovers, f"rank processes left behind: {leftovers}"


@pytest.mark.slow
def test_ranks_started_from_a_thread_outlive_it_and_a_ctrl_c(one_process, no_rank_left,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """An LLM built in a thread that then ends keeps its ranks (they live as long as this process), a Ctrl-C that
    reaches them (a terminal's goes to every process of its group) leaves them to the driver, and its shutdown
    stops them in order."""
    path, reference = one_process("llama")
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(LLM(path, tensor_parallel_size=2, **TIGHT)))
    thread.start()
    thread.join()
    llm = built.pop()
    try:
        ranks = _rank_pids(os.getpid())
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGINT)
        outs = llm.generate(_prompts(), GREEDY)
    finally:
        llm.shutdown()
    _assert_same(outs, reference)
    assert not any(alive(pid) for pid in ranks)
    assert _distributed_warnings(caplog) == []


@pytest.mark.slow
def test_a_dropped_llm_releases_its_ranks_and_process_group(one_process, no_rank_left) -> None:
    """`del llm` without shutdown(): its ranks end and the process group goes, so the next distributed LLM of the
    process starts (it was refused) and gives the same tokens."""
    path, reference = one_process("llama")
    llm = LLM(path, tensor_parallel_size=2, **TIGHT)
    ranks = _rank_pids(os.getpid())
    first = llm.generate(_prompts(), GREEDY)
    del llm
    gc.collect()
    assert wait_for(lambda: not any(alive(pid) for pid in ranks), timeout=15)
    assert not dist.is_initialized()
    with LLM(path, tensor_parallel_size=2, **TIGHT) as llm:
        second = llm.generate(_prompts(), GREEDY)
    _assert_same(second, first)
    _assert_same(first, reference)


@pytest.mark.slow
def test_the_server_engine_stops_its_ranks_in_order(one_process, no_rank_left,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """AsyncLLM (the server's engine) builds the engine in its own thread and ends that thread before stopping
    the ranks: they take the shutdown call (no warning) and end."""
    path, _ = one_process("llama")
    engine = AsyncLLM(str(path), tensor_parallel_size=2, **TIGHT)

    async def serve_one_then_shut_down() -> list[int]:
        try:
            async for out in engine.generate(_prompts()[0], GREEDY):
                pass
            return out.outputs[0].token_ids
        finally:
            await engine.shutdown()

    ranks = _rank_pids(os.getpid())
    assert len(asyncio.run(serve_one_then_shut_down())) == GREEDY.max_tokens
    assert engine.failure is None
    assert not any(alive(pid) for pid in ranks)
    assert _distributed_warnings(caplog) == []


@pytest.mark.slow
def test_killing_the_driver_process_takes_its_ranks_down(one_process) -> None:
    """SIGKILL leaves the driver no time to stop anything: its ranks notice that its process ended and end."""
    path, _ = one_process("llama")
    script = (f"import sys\nfrom reasoning_engine import LLM\nllm = LLM({str(path)!r}, tensor_parallel_size=2, "
              f"**{TIGHT!r})\nprint('ready', flush=True)\nsys.stdin.read()\n")
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    ranks: list[int] = []
    try:
        assert driver.stdout.readline() == "ready\n"
        ranks = _rank_pids(driver.pid)
        assert len(ranks) == 1
        driver.kill()
        driver.wait(timeout=30)
        assert wait_for(lambda: not any(alive(pid) for pid in ranks), timeout=15)
    finally:
        driver.kill()
        driver.wait(timeout=30)
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_processes_ray_starts_from_a_passing_thread_outlive_it() -> None:
    """ray.init() starts a local cluster whose processes get Linux's parent-death signal from the starting thread
    (Ray's own preexec function): the engine starts it from a thread that lasts as long as this process."""
    from ray._private.utils import set_kill_on_parent_death_linux

    started: list[subprocess.Popen] = []

    def start() -> None:
        started.append(_in_lasting_thread(lambda: subprocess.Popen(["sleep", "60"],
                                                                   preexec_fn=set_kill_on_parent_death_linux)))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    proc = started[0]
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # still running, though the thread that asked for it ended
            proc.wait(timeout=0.5)
    finally:
        proc.kill()
        proc.wait()
