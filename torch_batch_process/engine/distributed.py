"""The distributed context: ranks, process groups and the library's own collectives.

A job runs as one plain process (``python script.py``), under ``torchrun``, or as processes started
with the env contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
The library initializes the default process group itself when the environment asks for more than
one process (nccl when every rank has a GPU of its own, else gloo), once every rank has joined with a deadline and
heartbeats (:mod:`~torch_batch_process.engine.join`: a rank lost while the job opens fails the others
within seconds, not after the collective timeout), and reuses a group the user already initialized. A
default group the library created stays for the later calls of the same process (a script may call
:func:`torch_batch_process` several times) and is destroyed when the interpreter exits: re-creating
it would re-run the rendezvous on a store that still holds the keys of the first one (under torchrun
the agent's store outlives the group), which made the second call fail or hang. A group the user
created is never destroyed.

The job's rendezvous store (the default group's) carries the dynamic schedule's shared counters and queues, per
call (:class:`RendezvousStore`).

Its own coordination (votes at commits, the per-step stop/failure agreement) runs on a gloo group
of its own, created and destroyed with each call, even when the default group is gloo too: it needs
no device synchronization, it never queues behind the user's collectives (nor they behind it), and a
peer that dies is noticed at once (gloo reports the closed connection) instead of after the NCCL
timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torch_batch_process import settings
from torch_batch_process.device import gpu_uuid, local_rank_device
from torch_batch_process.distributed_info import DistributedInfo
from torch_batch_process.engine import pending_collectives
from torch_batch_process.engine.join import connect_timeout, join_job
from torch_batch_process.errors import LOST_HINT, InvalidArgumentError, WorkerFailedError, WorkerLostError

__all__ = [
    "Collectives", "DistributedEnv", "Exchanged", "PendingExchange", "PendingMax", "RendezvousStore",
    "collective_timeout_s", "peers_answering", "wait_together",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

def collective_timeout_s() -> float:
    """Seconds a collective of the job may wait: ``TBP_COLLECTIVE_TIMEOUT_S`` (the call's settings), default 1800."""
    return settings.current().collective_timeout_s


def _sets_timeout() -> bool:
    """Whether this torch can change a connected group's timeout (``torch.distributed.set_timeout``, public in releases
    after 2.11): then the groups connect under :func:`connect_timeout` and get the collective timeout once connected.
    With an older torch they are created with the collective timeout (its private ``_set_pg_timeout`` did not reach
    gloo's collectives in some releases, pytorch#165422), so a peer that dies while they connect is noticed later."""
    return hasattr(dist, "set_timeout")


def _connect_timeout(collective: datetime.timedelta) -> datetime.timedelta:
    """The timeout a gloo group is created with (see :func:`_sets_timeout`)."""
    return connect_timeout() if _sets_timeout() else collective


def _extend_timeout(collective: datetime.timedelta, group: Any = None) -> None:
    """Gives a connected group the collective timeout (it already has it where torch cannot change it)."""
    if _sets_timeout():
        dist.set_timeout(collective, group)


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={value!r} must be an integer") from None


@contextlib.contextmanager
def peers_answering(rank: int) -> Iterator[None]:
    """Around a collective (started or waited for): what torch.distributed raises when a peer is gone becomes a
    :class:`WorkerLostError` naming this rank. Gloo reports a closed connection as a ``RuntimeError`` (or a
    ``ConnectionError``); an object collective whose peer died mid-message fails unpickling its bytes with an
    ``EOFError``; every collective of the library goes through here, so each of them says the same."""
    try:
        yield
    except (RuntimeError, ConnectionError, EOFError) as exc:
        raise WorkerLostError(f"rank {rank}: {LOST_HINT} ({exc})") from exc


def wait_together(rank: int, *works: Any) -> None:
    """Waits for asynchronous collectives started together (``None``: nothing to wait for), raising a
    :class:`WorkerLostError` as soon as one of them fails, not after the others.

    Why not one ``wait()`` after the other: gloo holds a send until its receiver asks for it, and a send whose
    receiver raised (and exited) before asking is not failed when the connection closes: it waits for the
    collective timeout (30 min). When a rank dies during a commit, a surviving rank's flags ``all_reduce`` fails
    at once while its vote's send to rank 0, which had already given up, would hang.
    """
    pending = [work for work in works if work is not None]
    pause = 0.0005  # the works usually completed during the step they overlapped: no wait at all
    while pending:
        for work in [work for work in pending if work.is_completed()]:
            with peers_answering(rank):
                work.wait()  # raises what made it fail
            pending.remove(work)
        if pending:
            time.sleep(pause)
            pause = min(2 * pause, 0.005)  # a late wake-up delays the commit by at most this


class Collectives:
    """The library's collectives over a gloo group; a single process needs none."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, obj: Any) -> list[Any]:
        """``all_gather_object``: every rank gets every rank's object."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with peers_answering(self.rank):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``broadcast_object_list`` of one object from ``src``."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        with peers_answering(self.rank):
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def from_rank0(self, compute: Callable[[], T], what: str) -> T:
        """Rank 0 runs ``compute`` (reading storage, say); every rank gets its answer, or raises the exception it
        raised (one that does not pickle becomes a :class:`WorkerFailedError` that says it came from ``what``)."""
        answer: Any = None
        if self.rank == 0:
            try:
                answer = compute()
            except Exception as exc:  # noqa: BLE001 - sent to every rank, then raised everywhere
                answer = _picklable(exc, what)
        answer = self.broadcast(answer)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]

    def gather(self, obj: Any) -> list[Any] | None:
        """``gather_object`` to rank 0: rank 0 gets every rank's object, the others ``None``."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        with peers_answering(self.rank):
            dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def start_exchange(self, header: list[int], obj: Any, capacity: int = 4096) -> PendingExchange:
        """Starts sending every rank a few integers (``header``) and rank 0 a picklable object from every rank, with
        one collective, without waiting (see :class:`PendingExchange`)."""
        return PendingExchange(self, header, obj, capacity)

    def start_max(self, values: list[int]) -> PendingMax:
        """Starts an asynchronous element-wise MAX of small integers over the ranks.

        It is an ``all_gather`` of every rank's integers, each rank taking the maximum itself: with gloo, a MAX
        ``all_reduce`` of 3 integers cost 0.7-0.9 ms of CPU per rank and 2.7 ms of latency on 2 ranks, the
        ``all_gather`` 0.5 ms and 1.5 ms (W x the integers' bytes: nothing beside a collective's fixed cost)."""
        if self.world_size == 1:  # nothing to reduce: no tensor (a commit of one process makes one per commit)
            return PendingMax(list(values), None, self.rank)
        tensor = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64)
        with peers_answering(self.rank):
            work = dist.all_gather_single(out, tensor, group=self.group, async_op=True)
        pending_collectives.started(work, self.group)
        return PendingMax(out.view(self.world_size, len(values)), work, self.rank)


@dataclass
class Exchanged:
    """What a :class:`PendingExchange` brought, once complete."""

    headers: list[list[int]]
    """Every rank's header, in rank order (the same on every rank)."""
    objects: list[Any] | None
    """Rank 0: every rank's object in rank order (``None`` for one that did not fit); the others: ``None``."""
    overflow: bool
    """Some rank's object did not fit (the same on every rank: the caller then gathers the objects again)."""


class PendingExchange:
    """One asynchronous collective that overlaps with work: every rank learns every rank's ``header`` (a few
    integers), and rank 0 every rank's picklable object; completed by :meth:`wait`.

    Each rank packs its header and its pickled object into one fixed-size buffer (``capacity`` bytes for the object)
    and the buffers are all-gathered: one collective where a gather of the objects and a MAX ``all_reduce`` of the
    integers took two (each costs a gloo op's fixed ~0.3 ms of CPU per rank; the buffer's bytes are nothing beside
    it). Only rank 0 unpickles the objects (O(W) for rank 0, O(1) for every other rank, which reads the headers
    alone: an ``all_gather_object`` made every rank unpickle every object, at 32 ranks 4.6 ms of CPU per rank). An
    object that does not fit is not sent: its header says so (:attr:`Exchanged.overflow`, on every rank), and the
    caller gathers the objects again, all ranks together.
    """

    def __init__(self, coll: Collectives, header: list[int], obj: Any, capacity: int) -> None:
        self._coll = coll
        self._obj = obj
        self._header = [int(value) for value in header]
        self._work: Any = None
        self._layout = struct.Struct(f"<{1 + len(header)}q")  # the object's length (-1: did not fit), the header
        self._size = self._layout.size + capacity
        self._out: torch.Tensor | None = None
        if coll.world_size == 1:
            return
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        length = len(data) if len(data) <= capacity else -1
        self._sent = bytearray(self._size)  # kept until the collective completes (the tensor shares its memory)
        self._layout.pack_into(self._sent, 0, length, *self._header)
        if length > 0:
            start = self._layout.size
            self._sent[start : start + length] = data
        self._out = torch.empty(coll.world_size * self._size, dtype=torch.uint8)
        with peers_answering(coll.rank):
            self._work = dist.all_gather_single(
                self._out, torch.frombuffer(self._sent, dtype=torch.uint8), group=coll.group, async_op=True
            )
        pending_collectives.started(self._work, coll.group)

    @property
    def work(self) -> Any:
        """The collective in flight (``None`` for one process), for :func:`wait_together`."""
        return self._work

    def wait(self) -> Exchanged:
        """Waits for the collective (raising :class:`WorkerLostError` when a peer is gone); what it brought."""
        if self._out is None:  # one process
            return Exchanged([self._header], [self._obj], False)
        wait_together(self._coll.rank, self._work)
        pending_collectives.settled(self._work)
        received = memoryview(self._out.numpy())
        headers: list[list[int]] = []
        objects: list[Any] = []
        overflow = False
        start = self._layout.size
        for offset in range(0, len(received), self._size):
            length, *header = self._layout.unpack_from(received, offset)
            headers.append(header)
            overflow = overflow or length < 0
            if self._coll.rank == 0:
                body = received[offset + start : offset + start + length]
                objects.append(pickle.loads(body) if length >= 0 else None)
        return Exchanged(headers, objects if self._coll.rank == 0 else None, overflow)


class PendingMax:
    """An element-wise MAX in flight (``values``: every rank's integers, one row each, being gathered; or the values
    of one process)."""

    def __init__(self, values: torch.Tensor | list[int], work: Any, rank: int) -> None:
        self._values = values
        self._work = work
        self._rank = rank

    @property
    def work(self) -> Any:
        """The collective in flight (``None`` for one process or once waited for), for :func:`wait_together`."""
        return self._work

    def wait(self) -> list[int]:
        if self._work is not None:
            with peers_answering(self._rank):
                self._work.wait()
            pending_collectives.settled(self._work)
            self._work = None
        if isinstance(self._values, torch.Tensor):
            return [max(column) for column in zip(*self._values.tolist(), strict=True)]
        return [int(v) for v in self._values]


class RendezvousStore:
    """Counters and queues in the job's rendezvous store; losing the store (rank 0's process hosts it under
    the plain env contract, torchrun's agent otherwise) means losing the job's other ranks, so every error
    is a :class:`WorkerLostError` (except the timeout of a blocking :meth:`queue_pop`, which just waited)."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank

    def _lost(self, exc: BaseException) -> WorkerLostError:
        return WorkerLostError(f"rank {self._rank}: the job's rendezvous store stopped answering ({exc}); {LOST_HINT}")

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        """Turns any error of the store (connection refused, reset, timeout...) into :meth:`_lost`'s."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    def add(self, key: str, amount: int) -> int:
        with self._answering():
            return int(self._store.add(key, amount))

    def set(self, key: str, value: bytes) -> None:
        with self._answering():
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        """The value of a key that was set (a key that was not makes the store wait, then time out)."""
        with self._answering():
            return bytes(self._store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` in one request (each must exist: the store waits for a missing key)."""
        with self._answering():
            return list(self._store.multi_get(keys))

    def queue_push(self, key: str, value: bytes) -> None:
        with self._answering():
            self._store.queue_push(key, value)

    def queue_len(self, key: str) -> int:
        with self._answering():
            return int(self._store.queue_len(key))

    def queue_pop(self, key: str) -> bytes | None:
        """The next item, waiting for one; ``None`` when the store's wait timed out (call again)."""
        try:
            return self._store.queue_pop(key, block=True)
        except Exception as exc:  # noqa: BLE001
            if "timeout" in str(exc).lower():
                return None
            raise self._lost(exc) from exc

    def clone(self) -> RendezvousStore:
        """A connection of its own (for another thread)."""
        with self._answering():
            return RendezvousStore(self._store.clone(), self._rank)


class DistributedEnv:
    """Sets up (or reuses) torch.distributed for a job and tears down what it created."""

    def __init__(
        self, timeout_s: float | None = None, expected: Any = None, preempted: Callable[[], bool] | None = None
    ) -> None:
        self._preempted = preempted  # a rank asked to stop waits less for ranks that have not joined (engine/join.py)
        self._timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else collective_timeout_s())
        self._expected = expected
        self._created_control = False
        self.control_group: dist.ProcessGroup | None = None
        self.device = torch.device("cpu")
        self.info = DistributedInfo(0, 1, 0, 1, 0, 1)
        self.collectives = Collectives(None, 0, 1)

    def __enter__(self) -> DistributedEnv:
        try:
            self.setup()
        except BaseException:
            self.teardown(failed=True)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.teardown(failed=exc_type is not None)

    def setup(self) -> None:
        """Joins the job's process group (initializing it when needed) and picks the device."""
        initialized = dist.is_available() and dist.is_initialized()
        if initialized:
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            world_size = _env_int("WORLD_SIZE", 1) or 1
            rank = _env_int("RANK", 0) or 0
            if world_size < 1 or not 0 <= rank < world_size:
                raise InvalidArgumentError(f"invalid environment: RANK={rank} must be in [0, WORLD_SIZE={world_size})")
        local_rank = _env_int("LOCAL_RANK", rank if world_size == 1 else None)
        if local_rank is None:
            local_rank = rank  # no LOCAL_RANK: assume one process per node slot, all on this node
        # The environment is left as it is (no LOCAL_RANK written for others to read): torch needs none from the
        # library (the device is made current here, so a DeviceMesh keeps it; get_node_local_rank() takes a
        # fallback_rank), and a processor has context.device and context.distributed.get_local_rank().
        self.device = local_rank_device(local_rank)
        _check_expected(self._expected, rank, world_size, initialized)
        if world_size > 1 and not initialized:
            missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
            if missing:
                raise InvalidArgumentError(
                    f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set: start the job with torchrun or "
                    "python -m torch_batch_process.launch.torch_distributed, or set MASTER_ADDR and MASTER_PORT"
                )
            logger.debug("joining the job (rank %d of %d)", rank, world_size)
            gpu = gpu_uuid(self.device) if self.device.type == "cuda" else None
            # or a WorkerLostError naming who did not join
            store, any_gloo = join_job(rank, world_size, gpu=gpu, preempted=self._preempted)
            backend = "gloo" if any_gloo else "nccl"
            if any_gloo and self.device.type == "cuda" and rank == 0:
                logger.warning(
                    "some ranks share a GPU (more processes than GPUs on a machine) or have none: NCCL cannot run "
                    "two ranks on one GPU, so the default process group uses gloo. For NCCL, start one process per "
                    "GPU (torchrun --nproc-per-node <number of GPUs>)"
                )
            logger.debug("initializing the %s process group (rank %d of %d)", backend, rank, world_size)
            kwargs: dict[str, Any] = {}
            if backend == "nccl":
                kwargs["device_id"] = self.device
            timeout = _connect_timeout(self._timeout) if backend == "gloo" else self._timeout
            with _lost_while("connecting the default process group", rank):
                dist.init_process_group(
                    backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
                    timeout=timeout, **kwargs,
                )
            _extend_timeout(self._timeout)  # connected: the job's collectives get the collective timeout
            store.set_timeout(self._timeout)
            _destroy_at_exit()
        if world_size > 1:
            with _lost_while("connecting the library's process group", rank):
                self.control_group = dist.new_group(backend="gloo", timeout=_connect_timeout(self._timeout))
            _extend_timeout(self._timeout, self.control_group)
            self._created_control = True
        self.collectives = Collectives(self.control_group, rank, world_size)
        local_size = _env_int("LOCAL_WORLD_SIZE", None)
        cross_rank = _env_int("GROUP_RANK", None)
        if world_size > 1 and (local_size is None or cross_rank is None):
            hosts = self.collectives.all_gather(socket.gethostname())
            distinct = list(dict.fromkeys(hosts))
            local_size = hosts.count(hosts[rank])
            cross_rank = distinct.index(hosts[rank])
            cross_size = len(distinct)
        else:
            local_size = local_size or 1
            cross_rank = cross_rank or 0
            cross_size = max(1, world_size // max(local_size, 1))
        self.info = DistributedInfo(
            rank=rank,
            size=world_size,
            local_rank=local_rank,
            local_size=local_size,
            cross_rank=cross_rank,
            cross_size=cross_size,
            _collectives=self.collectives,
        )

    def call_store(self, call_id: str) -> RendezvousStore:
        """This call's keys in the job's rendezvous store (the default group's store): shared counters and
        queues of the dynamic schedule. ``call_id`` keeps calls (and torchrun restarts) apart, since the
        store may outlive the call (under torchrun it is the agent's)."""
        from torch.distributed import distributed_c10d

        prefixed = dist.PrefixStore(f"tbp/{call_id}/", distributed_c10d._get_default_store())
        return RendezvousStore(prefixed, self.info.rank)

    def teardown(self, failed: bool = False) -> None:
        """Destroys this call's control group (the default group stays for later calls, see above); after a
        ``failed`` call that left a collective in flight, keeps its groups alive instead (destroying one would wait
        on a peer that may never come: :mod:`~torch_batch_process.engine.pending_collectives`)."""
        left = pending_collectives.pending_groups() if failed else []
        if left:
            control = [self.control_group] if self.control_group is not None else []
            pending_collectives.keep_until_exit([*left, *control])
            self._created_control = False
            self.control_group = None
            return
        if self._created_control and self.control_group is not None:
            try:
                dist.destroy_process_group(self.control_group)
            except Exception as exc:  # noqa: BLE001 - teardown must not mask the job's outcome
                logger.debug("destroying the control group failed: %s", exc)
            self._created_control = False
            self.control_group = None


@contextlib.contextmanager
def _lost_while(what: str, rank: int) -> Iterator[None]:
    """A failure to connect a process group once every rank joined (a peer died in that window, or the connect
    timeout passed) as a :class:`WorkerLostError` saying so."""
    try:
        yield
    except (RuntimeError, ConnectionError, TimeoutError) as exc:
        raise WorkerLostError(
            f"rank {rank}: {what} failed after every rank joined the job: a rank stopped meanwhile (see the other "
            f"ranks' logs) ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''})"
        ) from exc


_exit_hook_registered = False


def _destroy_at_exit() -> None:
    """Destroys the default group the library created when the interpreter exits (once)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_default_group)
        _exit_hook_registered = True


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the interpreter is exiting
            logger.debug("destroying the process group failed: %s", exc)


def _check_expected(expected: Any, rank: int, world_size: int, initialized: bool) -> None:
    """Checks Determined's ``distributed_context`` argument against what torch.distributed says.

    The library always runs on torch.distributed; a ``DistributedContext``-like object (Determined's
    ``core.DistributedContext``, or this library's :class:`DistributedInfo`) only states the ranks the
    caller expects, so a mismatch (e.g. a context for 4 processes in a job started with 2) is an error
    instead of a silent re-sharding.
    """
    if expected is None:
        return
    sizes = []
    for name in ("get_size", "get_rank"):
        getter = getattr(expected, name, None)
        if not callable(getter):
            raise InvalidArgumentError(
                f"distributed_context must be None or a DistributedContext-like object with get_rank() and "
                f"get_size() (e.g. determined.core.DistributedContext.from_torch_distributed()), got "
                f"{type(expected).__name__}"
            )
        sizes.append(getter())
    size, expected_rank = sizes
    if (size, expected_rank) != (world_size, rank):
        where = "torch.distributed" if initialized else "the environment (RANK, WORLD_SIZE)"
        raise InvalidArgumentError(
            f"distributed_context says rank {expected_rank} of {size}, but {where} says rank {rank} of "
            f"{world_size}: start the job with as many processes as the context describes (torchrun "
            "--nproc-per-node, or the library's launcher), or pass distributed_context=None"
        )


def _picklable(exc: BaseException, what: str) -> BaseException:
    """``exc`` if it survives pickling (to be re-raised on every rank), else a stand-in with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling problem
        return WorkerFailedError(f"rank 0 failed while {what}: {type(exc).__name__}: {exc}")
