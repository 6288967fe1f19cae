"""Several processes, one model: starting the ranks, their process groups, and the calls they make in lockstep.

Rank 0 is the engine's own process (the driver: scheduler, sampling, detokenizer, speculative proposers). Every other
rank runs `serve_rank`: it builds its `ModelWorker` (its shard of the model and its KV cache) and then makes, in
order, the calls rank 0 broadcasts (`DistributedExecutor`): the same forward passes over the same inputs, so that the
collectives inside the model meet. Calls travel over a gloo group on every backend; the model's own collectives use
NCCL on CUDA and gloo on CPU.

Ranks are laid out data-parallel replica by replica: rank = dp_rank * tensor_parallel_size + tp_rank. They start as
child processes of each node's launcher (`mp`: `python -m reasoning_engine.engine.distributed`, which never re-imports
the user's script) or as Ray actors in a placement group (`ray`), and meet at a TCPStore on node 0
(master_addr:master_port), which also hands them the engine config.

A rank that dies or raises is noticed by the driver's monitor (its process ends, or its Ray task does): the other
ranks are stopped, so that no collective waits for it, and the failure callbacks run (the server fails its requests
and exits). Each rank also ends when the driver's connection drops, and a child-process rank when the driver's
process ends, however it ends (`launch_ranks`' lifeline: whichever thread started the ranks may come and go). An
executor collected without `shutdown()` (an `LLM` dropped in a notebook) stops its ranks and releases the process
group, so that the next distributed engine in the process can start.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from reasoning_engine.config import EngineConfig, ParallelConfig
from reasoning_engine.engine.worker import DraftObservation, ModelWorker, StepInput
from reasoning_engine.parallel import Group, Parallel
from reasoning_engine.speculative.decoder import ProposeItem
from reasoning_engine.speculative.draft import Draft

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = timedelta(seconds=600)  # ranks must all have started (and Ray placed them) within this
_CONFIG_KEY = "engine_config"


class WorkerFailed(RuntimeError):
    """A rank's process ended or raised: the engine cannot step any more."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_parallel(rank: int, config: ParallelConfig, device_backend: str) -> tuple[Parallel, dist.ProcessGroup]:
    """This rank's groups, and the gloo group the driver's calls travel on. Every rank creates every group, in the
    same order, as torch.distributed requires."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    control = dist.new_group(backend="gloo")
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp)), backend=device_backend) if tp > 1 else None
                 for d in range(dp)]
    dp_groups = [dist.new_group(list(range(t, tp * dp, tp)), backend=device_backend) if dp > 1 else None
                 for t in range(tp)]
    dp_rank, tp_rank = divmod(rank, tp)
    parallel = Parallel(
        tp=Group(tp_rank, tp, tp_groups[dp_rank]),
        ep=Group(rank, tp * dp, dist.group.WORLD) if config.enable_expert_parallel else None,
        dp=Group(dp_rank, dp, dp_groups[tp_rank]),
    )
    return parallel, control


def _rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    if config.device.type != "cuda":
        return config.device
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _threads_for(local_ranks: int) -> int:
    """CPU ranks on one machine share its cores."""
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _smallest(values: list[int], group: dist.ProcessGroup) -> list[int]:
    """Each entry's smallest value over the ranks (blocks per pool: what every rank can hold)."""
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return tensor.tolist()


def _start_worker(config: EngineConfig, rank: int, control: dist.ProcessGroup, parallel: Parallel) -> ModelWorker:
    """Build this rank's worker and allocate the KV cache every rank can hold."""
    local_ranks = config.parallel.ranks_per_node
    worker = ModelWorker(config, parallel, local_ranks=local_ranks)
    worker.init_cache(_smallest(worker.available_blocks(), control))
    return worker


def _init_process_group(config: EngineConfig, store: dist.Store, rank: int) -> str:
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("engine", store), rank=rank,
                            world_size=config.parallel.world_size, timeout=timedelta(minutes=30))
    return backend


def serve_rank(rank: int, master_addr: str, master_port: int) -> None:
    """A non-driver rank: meet the others, build this rank's worker, then make the driver's calls until it says
    stop (or its connection drops, which raises)."""
    store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=STARTUP_TIMEOUT)
    config: EngineConfig = pickle.loads(store.get(_CONFIG_KEY))
    local_rank = rank % config.parallel.ranks_per_node
    config = dataclasses.replace(config, device=_rank_device(config, local_rank))
    if config.device.type == "cpu":
        torch.set_num_threads(_threads_for(config.parallel.ranks_per_node))
    backend = _init_process_group(config, store, rank)
    parallel, control = build_parallel(rank, config.parallel, backend)
    worker = _start_worker(config, rank, control, parallel)
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        method, args, gather = message[0]
        if method == "shutdown":
            break
        result = getattr(worker, method)(*args)
        if gather:
            dist.gather_object(result, None, dst=0, group=control)
    dist.destroy_process_group()


_LIFELINES: set[int] = set()  # this process's write ends of its ranks' lifelines


def _close_lifelines_in_child() -> None:
    """A fork of the driver (a DataLoader worker, say) must not hold the lifelines: its ranks would outlive it."""
    for fd in _LIFELINES:
        os.close(fd)
    _LIFELINES.clear()


os.register_at_fork(after_in_child=_close_lifelines_in_child)


def launch_ranks(ranks: range, master_addr: str, master_port: int) -> tuple[list[subprocess.Popen], int]:
    """Start these ranks as child processes of this one (the `mp` backend, and nodes other than node 0), and return
    them with their lifeline: the write end of a pipe they watch (`_exit_with_driver`). Only this process holds it
    and nothing is written to it, so it reads as closed once this process has ended, or once `close_lifeline` closes
    it; unlike Linux's parent-death signal, which follows the thread that started a child, not its process."""
    read_end, write_end = os.pipe()  # neither end is inherited by processes started later
    _LIFELINES.add(write_end)
    procs = []
    try:
        for rank in ranks:
            cmd = [sys.executable, "-m", "reasoning_engine.engine.distributed", "--rank", str(rank),
                   "--master-addr", master_addr, "--master-port", str(master_port), "--lifeline", str(read_end)]
            procs.append(subprocess.Popen(cmd, pass_fds=(read_end,)))
    except BaseException:
        for proc in procs:
            proc.kill()
        close_lifeline(write_end)
        raise
    finally:
        os.close(read_end)
    return procs, write_end


def close_lifeline(write_end: int) -> None:
    """Ranks still running on this lifeline end now."""
    if write_end in _LIFELINES:
        _LIFELINES.discard(write_end)
        os.close(write_end)


def _exit_with_driver(lifeline: int) -> None:
    """End this rank as soon as its lifeline reads as closed (the driver's process ended, or it let the rank go)."""

    def watch() -> None:
        while os.read(lifeline, 1):  # the driver never writes: only end-of-file comes back
            pass
        os._exit(1)

    threading.Thread(target=watch, name="driver-lifeline", daemon=True).start()


def run_node(config: ParallelConfig) -> int:
    """A node other than node 0 (`serve --nnodes K --node-rank R`): start this node's ranks and wait for them; the
    exit status is the first failing rank's, else 0."""
    per_node = config.ranks_per_node
    procs, _ = launch_ranks(range(config.node_rank * per_node, (config.node_rank + 1) * per_node),
                            config.master_addr, config.master_port)  # the lifeline is closed when this process ends

    def stop(_signum: int, _frame: Any) -> None:
        for proc in procs:
            proc.terminate()  # ranks ignore SIGINT (see `main`)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [proc.wait() for proc in procs]
    return next((code for code in codes if code), 0)


class _Ranks:
    """The driver's hold on ranks 1..: their processes (or Ray actors), the store they met at, the gloo group calls
    travel on, and why they failed. It holds nothing of the executor's, so that the executor's finalizer (and the
    monitor thread) can keep it without keeping the executor alive."""

    def __init__(self, store: dist.TCPStore, threads: int) -> None:
        self.store: dist.TCPStore | None = store
        self.threads = threads  # this process's torch threads before the engine started, restored at shutdown
        self.procs: list[subprocess.Popen] = []
        self.lifeline: int | None = None
        self.ray_tasks: list[Any] = []
        self.ray_actors: list[Any] = []
        self.ray_group: Any = None  # the placement group the actors hold, removed at shutdown
        self.control: dist.ProcessGroup | None = None
        self.failure: str | None = None
        self.callbacks: list[Callable[[str], None]] = []
        self.stopped = False

    def watch(self) -> None:
        """The monitor: stop every rank and run the failure callbacks once one rank has died or raised."""
        while not self.stopped:
            reason = self.dead_rank()
            if reason is not None:
                self.failure = reason
                logger.error("%s: stopping the other ranks", reason)
                self.kill()
                for callback in self.callbacks:
                    callback(reason)
                return
            time.sleep(0.2)

    def dead_rank(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None and not self.stopped:
                return f"rank {rank} (pid {proc.pid}) exited with status {code}"
        if self.ray_tasks:
            import ray

            done, _ = ray.wait(self.ray_tasks, timeout=0)
            if done and not self.stopped:
                rank = self.ray_tasks.index(done[0]) + 1
                try:
                    ray.get(done[0])
                    return f"rank {rank} (Ray actor) stopped"
                except Exception as exc:  # noqa: BLE001 - the actor's error is the reason
                    return f"rank {rank} (Ray actor) failed: {exc}"
        return None

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        if self.ray_actors:
            import ray

            for actor in self.ray_actors:
                ray.kill(actor)

    def shutdown(self) -> None:
        """Tell every rank to stop and wait for them (killing what does not stop within 10 s), then release the
        process group and the store. Called once, by the executor's finalizer."""
        self.stopped = True
        if self.failure is None and dist.is_initialized() and self.control is not None:
            try:
                dist.broadcast_object_list([("shutdown", (), False)], src=0, group=self.control)
            except RuntimeError:  # a rank is already gone: it is killed below
                logger.warning("a rank did not take the shutdown call")
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.lifeline is not None:
            close_lifeline(self.lifeline)
        if self.ray_tasks:
            import ray

            ray.wait(self.ray_tasks, num_returns=len(self.ray_tasks), timeout=max(0.1, deadline - time.monotonic()))
            self.kill()
        if self.ray_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.ray_group)  # its resources go back to the user's cluster
        # dropped while Ray is still connected: a handle freed after ray.shutdown() makes Ray end the process
        self.ray_tasks, self.ray_actors, self.ray_group = [], [], None
        if dist.is_initialized() and self.failure is None:  # after a failure a thread may be stuck in a collective
            dist.destroy_process_group()
        self.control = self.store = None
        torch.set_num_threads(self.threads)


class DistributedExecutor:
    """The driver's handle on all ranks: `local` is rank 0's worker in this process, and each call is broadcast to
    the other ranks before rank 0 makes it (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel
        if dist.is_initialized():
            raise RuntimeError("this process already runs a distributed engine (or another torch.distributed job): "
                               "shut that engine down first")
        port = pc.master_port or free_port(pc.master_addr)
        config = dataclasses.replace(config, parallel=dataclasses.replace(pc, master_port=port))
        threads = torch.get_num_threads()
        if config.device.type == "cpu":
            torch.set_num_threads(_threads_for(pc.ranks_per_node))
        store = dist.TCPStore(pc.master_addr, port, pc.world_size, is_master=True, wait_for_workers=False,
                              timeout=STARTUP_TIMEOUT)
        store.set(_CONFIG_KEY, pickle.dumps(config))
        self._ranks = ranks = _Ranks(store, threads)
        # when this executor is collected (or Python exits) without shutdown(), the ranks are stopped all the same
        self._finalizer = weakref.finalize(self, ranks.shutdown)
        try:
            if pc.distributed_executor_backend == "ray":
                self._start_ray(config, port)
            else:
                ranks.procs, ranks.lifeline = launch_ranks(range(1, pc.ranks_per_node), pc.master_addr, port)
            self._monitor = threading.Thread(target=ranks.watch, name="rank-monitor", daemon=True)
            self._monitor.start()
            config = dataclasses.replace(config, device=_rank_device(config, 0))
            backend = _init_process_group(config, store, 0)
            parallel, ranks.control = build_parallel(0, config.parallel, backend)
            self.local = _start_worker(config, 0, ranks.control, parallel)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = self.local.num_blocks

    @property
    def failure(self) -> str | None:
        """Why the ranks cannot step together any more (a rank died or raised), else None."""
        return self._ranks.failure

    # ---- the calls every rank makes ----
    def _call(self, method: str, *args: Any, gather: bool = False) -> Any:
        """Rank 0's result of `method` (every rank's, with `gather`). Any failure leaves the ranks out of step: the
        executor is then dead and the other ranks are stopped."""
        ranks = self._ranks
        if ranks.failure is not None:
            raise WorkerFailed(ranks.failure)
        try:
            dist.broadcast_object_list([(method, args, gather)], src=0, group=ranks.control)
            result = getattr(self.local, method)(*args)
            if not gather:
                return result
            results: list[Any] = [None] * dist.get_world_size()
            dist.gather_object(result, results, dst=0, group=ranks.control)
            return results
        except Exception as exc:
            if ranks.failure is None:
                # a collective that fails is most often another rank's death: name that rank if it is found
                deadline = time.monotonic() + 1.0
                while (reason := ranks.dead_rank()) is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                ranks.failure = reason or f"rank 0 failed in {method}: {exc}"
                ranks.kill()
            raise WorkerFailed(ranks.failure) from exc

    def execute_model(self, steps: list[StepInput]) -> list[torch.Tensor]:
        return self._call("execute_model", steps)

    def observe_drafts(self, observations: list[DraftObservation]) -> None:
        self._call("observe_drafts", observations)

    def propose_drafts(self, method: str, items: list[list[ProposeItem]]) -> list[list[Draft]]:
        return self._call("propose_drafts", method, items)

    def release_draft_state(self, method: str, seq_id: str) -> None:
        self._call("release_draft_state", method, seq_id)

    def move_kv(self, replica: int, block_tables: list[list[int]], moves: list[tuple[int, int]]) -> None:
        self._call("move_kv", replica, block_tables, moves)

    def kv_tier_ops(self, replica: int, ops: list[Any]) -> None:
        self._call("kv_tier_ops", replica, ops)

    def gather(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result of the worker method `method`, in rank order (reports such as `memory_report`)."""
        return self._call(method, *args, gather=True)

    # ---- faults and shutdown ----
    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (from the monitor thread) when a rank dies or raises."""
        self._ranks.callbacks.append(callback)

    def shutdown(self) -> None:
        """Stop every rank and release the process group (`_Ranks.shutdown`); idempotent."""
        self._finalizer()

    # ---- Ray ----
    def _start_ray(self, config: EngineConfig, port: int) -> None:
        """One actor per rank 1.. in a placement group of the Ray cluster this process is connected to (or one it
        finds at `ray start`'s address, else a local one), each bundle a GPU on CUDA or a CPU."""
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'reasoning-engine[ray]'") from exc
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto") if _ray_cluster_running() else None
            # the local cluster ray.init() starts dies with the thread that started it (Ray sets Linux's
            # parent-death signal on its processes), and the engine may be built in a thread that ends first
            _in_lasting_thread(lambda: ray.init(address=address, include_dashboard=False, log_to_driver=True))
        pc = config.parallel
        resource = {"GPU": 1} if config.device.type == "cuda" else {"CPU": 1}
        group = placement_group([resource] * (pc.world_size - 1), strategy="PACK")
        self._ranks.ray_group = group
        ray.get(group.ready(), timeout=STARTUP_TIMEOUT.total_seconds())
        actor_cls = ray.remote(num_cpus=resource.get("CPU", 0), num_gpus=resource.get("GPU", 0))(_RankActor)
        master = ray.util.get_node_ip_address() if pc.master_addr in ("127.0.0.1", "localhost") and pc.nnodes > 1 \
            else pc.master_addr
        for rank in range(1, pc.world_size):
            actor = actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank - 1)).remote()
            self._ranks.ray_actors.append(actor)
            self._ranks.ray_tasks.append(actor.run.remote(rank, master, port))


_lasting_calls: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue]] | None = None
_lasting_lock = threading.Lock()


def _in_lasting_thread(call: Callable[[], Any]) -> Any:
    """`call()`, made in a thread that lasts as long as this process (started on first use)."""
    global _lasting_calls
    with _lasting_lock:
        if _lasting_calls is None:
            _lasting_calls = queue.SimpleQueue()
            threading.Thread(target=_serve_calls, args=(_lasting_calls,), name="lasting-calls", daemon=True).start()
    answer: queue.SimpleQueue = queue.SimpleQueue()
    _lasting_calls.put((call, answer))
    ok, value = answer.get()
    if not ok:
        raise value
    return value


def _serve_calls(calls: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue]]) -> None:
    while True:
        call, answer = calls.get()
        try:
            answer.put((True, call()))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            answer.put((False, exc))


def _ray_cluster_running() -> bool:
    """A cluster to join: RAY_ADDRESS set, or `ray start` left its address file on this machine."""
    return bool(os.environ.get("RAY_ADDRESS")) or os.path.exists("/tmp/ray/ray_current_cluster")


class _RankActor:
    """A rank inside a Ray actor: `run` serves until the driver's shutdown call."""

    def run(self, rank: int, master_addr: str, master_port: int) -> int:
        serve_rank(rank, master_addr, master_port)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One rank of a distributed engine (started by the engine itself).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--lifeline", type=int, required=True, help="file descriptor: end when it reads as closed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"rank {args.rank} %(levelname)s %(name)s: %(message)s")
    _exit_with_driver(args.lifeline)
    # Ctrl-C in a terminal interrupts every process of the foreground group: the driver then stops the ranks in
    # order (its shutdown call), which a rank interrupted first could not take
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve_rank(args.rank, args.master_addr, args.master_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
