"""Tensor parallelism's processes (the groups and collectives are pagedllm/distributed/).

Rank 0 runs the engine and a DriverWorker; every other rank runs `worker_loop`: a Worker
holding its shard of the model and of the KV cache (its KV heads, the same block numbers),
which applies each StepBatch rank 0 broadcasts (pagedllm/contract.py: plain data, pickled over
the gloo CPU group by broadcast_object_list) to its own copy of the per-sequence state and
runs the same forward, joining the all-reduces of the sharded layers.
Logits are all-gathered, so every rank samples the same tokens (same seeds, same global
generator seed): a multi-step decode's next input ids are on every rank without another
message. The engine reads rank 0's results.

Launch: on one machine `create_worker` starts ranks 1..N-1 with torch.multiprocessing
(spawn) over a TCP rendezvous on localhost. Under torchrun (`torchrun --nnodes M
--nproc-per-node K -m pagedllm.entrypoints.cli serve --tensor-parallel-size M*K ...`) every
process runs the same command: rank 0 goes on to the engine, the others never return from
`create_worker` (they serve steps until rank 0 stops, then exit).

Failure: every collective of the forward has the timeout `distributed_timeout`; a rank that
dies closes its sockets, which fails rank 0's next collective at once. Rank 0 raises
TensorParallelError naming the rank that failed (from its process's exit code, when rank 0
started it); the engine cannot go on after that.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator

import torch

from pagedllm.distributed import parallel_state as ps
from pagedllm.distributed.communication import broadcast_object
from pagedllm.config import EngineConfig
from pagedllm.engine_args import EngineArgs
from pagedllm.contract import GrammarMasks, StepBatch, StepResult
from pagedllm.worker.model_runner import PendingStep
from pagedllm.worker.worker import Worker, resolve_device

logger = logging.getLogger(__name__)

STOP = None  # the message that ends the worker loops



class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or stopped answering; the engine cannot go on."""

    fatal = True  # the server answers the requests in flight, then exits non-zero


def create_worker(args: EngineArgs, config: EngineConfig) -> Worker:
    """The engine's worker: a plain Worker, or with tensor parallelism rank 0's DriverWorker
    (starting the other ranks, or joining torchrun's). Under torchrun a rank other than 0
    serves steps here, under rank 0's `config` (the only one that read the tokenizer), and
    exits the process when rank 0 stops."""
    env = ps.torchrun_env()
    if env is None and args.tensor_parallel_size == 1:
        return Worker(args, config)
    if env is not None:
        world, rank, local_rank = env
        if world != args.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size is {args.tensor_parallel_size} but torchrun "
                             f"started {world} processes: they must be equal")
        _init(args, world, rank, local_rank, "env://", local_world=int(
            os.environ.get("LOCAL_WORLD_SIZE", world)))
        config = broadcast_object(config)
        if rank != 0:
            code = worker_loop(args, config)
            sys.exit(code)
        return DriverWorker(args, config, [])
    return DriverWorker(args, config, _spawn_ranks(args, config))


def _backend(args: EngineArgs) -> str:
    return "nccl" if resolve_device(args.device).type == "cuda" else "gloo"


def _init(args: EngineArgs, world: int, rank: int, local_rank: int, init_method: str,
          local_world: int) -> None:
    backend = _backend(args)
    if backend == "gloo":
        # The ranks of one machine share its cores (unless OMP_NUM_THREADS says otherwise).
        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads and threads.isdigit() else
                              max(1, (os.cpu_count() or 1) // local_world))
    elif local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor parallel rank {rank} needs GPU {local_rank} of this machine, "
                         f"but {torch.cuda.device_count()} are visible")
    else:
        torch.cuda.set_device(local_rank)  # NCCL's communicator lives on this rank's GPU
    ps.init_tensor_parallel(world, rank, local_rank, init_method, backend,
                            args.distributed_timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_ranks(args: EngineArgs, config: EngineConfig) -> list:
    """Start ranks 1..N-1 on this machine and join the group as rank 0."""
    size = args.tensor_parallel_size
    if _backend(args) == "nccl" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, but "
                         f"{torch.cuda.device_count()} are visible")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = torch.multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, size):
        p = context.Process(target=_rank_main, args=(args, config, size, rank, init_method),
                            name=f"pagedllm-tp-rank-{rank}", daemon=True)
        p.start()
        processes.append(p)
    try:
        _init(args, size, 0, 0, init_method, local_world=size)
    except BaseException as exc:
        dead = _dead_ranks(processes)
        _stop_processes(processes)
        if dead and isinstance(exc, RuntimeError):
            raise TensorParallelError(f"tensor parallel {dead} before joining") from exc
        raise
    return processes


def _rank_main(args: EngineArgs, config: EngineConfig, world: int, rank: int,
               init_method: str) -> None:
    """A spawned rank's process: rank 0's resolved config, no tokenizer."""
    logging.basicConfig(level=logging.WARNING)
    try:
        _init(args, world, rank, rank, init_method, local_world=world)
    except Exception as exc:  # rank 0 reports the failed rendezvous
        logger.error("tensor parallel rank %d could not join: %s", rank, exc)
        os._exit(1)
    code = worker_loop(args, config)
    logging.shutdown()
    os._exit(code)  # skip the interpreter's teardown: rank 0 waits for this exit


def worker_loop(args: EngineArgs, config: EngineConfig) -> int:
    """A rank other than 0: build its Worker (joining the collectives of loading and
    profiling), then apply every step rank 0 broadcasts until it says stop. The exit code:
    0 after a stop, 1 after an error (rank 0 sees the closed connection)."""
    try:
        worker = Worker(args, config)
        while True:
            batch = broadcast_object(None)
            if batch is STOP:
                worker.shutdown()  # the graphs go before the group (see DriverWorker)
                return 0
            worker.sample(worker.execute(batch), None)
    except ValueError as exc:  # a bad option or model: rank 0 raises the same error
        logger.debug("tensor parallel rank %d: %s", ps.tp_rank(), exc)
        return 1
    except Exception:
        logger.exception("tensor parallel rank %d failed", ps.tp_rank())
        return 1
    finally:
        ps.destroy_tensor_parallel()


class DriverWorker(Worker):
    """Rank 0's worker: each step goes to the other ranks first, then runs here."""

    defers_token_bitmask = False  # every rank samples: the mask would need a second broadcast

    def __init__(self, args: EngineArgs, config: EngineConfig, processes: list) -> None:
        self.processes = processes
        self._stopped = False
        try:
            with self._naming_failures():
                super().__init__(args, config)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    def execute(self, batch: StepBatch) -> PendingStep:
        if self._stopped:
            raise TensorParallelError("the tensor-parallel ranks were stopped")
        with self._naming_failures():
            broadcast_object(batch)
            return super().execute(batch)

    def sample(self, handle: PendingStep, masks: GrammarMasks | None) -> StepResult:
        """The masks are in the batch (every rank samples); on CUDA a failed collective of
        the step may show only now, as its samples are waited for."""
        with self._naming_failures():
            return super().sample(handle, None)

    # ---------------------------------------------------------------- failures
    @contextlib.contextmanager
    def _naming_failures(self) -> Iterator[None]:
        """A failed collective becomes a TensorParallelError naming the rank."""
        try:
            yield
        except (TensorParallelError, ValueError):
            raise
        except (RuntimeError, OSError) as exc:
            self._stopped = True
            raise TensorParallelError(self._describe_failure(exc)) from exc

    def _describe_failure(self, exc: BaseException) -> str:
        dead = _dead_ranks(self.processes)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if dead:
            return f"tensor parallel {dead}; the engine stops ({first})"
        return (f"a tensor parallel rank failed or did not answer within "
                f"{ps.state().timeout_s:g} s; the engine stops ({first})")

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (also at exit). Every rank
        releases its graphs, then leaves the group at the same time: with NCCL, destroying
        the group is collective. After a failure the graphs stay: waiting for the device
        could wait forever on a collective whose peer is gone."""
        if self._stopped:
            _stop_processes(self.processes)
            ps.destroy_tensor_parallel()
            return
        self._stopped = True
        if hasattr(self, "runner"):
            super().shutdown()
        try:
            broadcast_object(STOP)
        except Exception:  # a rank already gone
            pass
        ps.destroy_tensor_parallel()
        for p in self.processes:
            p.join(timeout=10)
        _stop_processes(self.processes)


def _dead_ranks(processes: list) -> str:
    """"rank 1 (pid 4242) was killed by SIGKILL, ..." for the started ranks that ended."""
    dead = []
    for rank, p in enumerate(processes, start=1):
        p.join(timeout=1.0)
        if p.exitcode is not None:
            dead.append(f"rank {rank} (pid {p.pid}) {_exit_text(p.exitcode)}")
    return ", ".join(dead)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop_processes(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
