"""Joining the job's processes: the rendezvous before the process groups, with a deadline and heartbeats.

``init_process_group`` waits for every rank inside C++ (the TCP store's server waits for its clients, gloo
waits in the store for each peer's address) with the group's timeout, 30 minutes by default, and nothing a
Python thread does can cut that wait short. A rank that is never started, or that dies while the job opens
(an OOM kill, a node lost, a bad argument on one node), then left the others hanging for half an hour when
the job was started as plain processes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: Slurm's
``srun``, Kubernetes without an agent; under torchrun or the library's launcher the agent stops the others).

So when the library creates the default group, every rank first connects to the job's TCP store (hosted by rank
0, or by torchrun's agent) and waits in a Python loop that watches the others (:func:`join_job`):

- each rank adds a heartbeat to the store every second while it waits; rank 0 watches every rank's, the others
  watch rank 0's (and lose the store at once when rank 0's process, which hosts it, dies). A rank that joined
  and then went silent for ``TBP_HEARTBEAT_SILENCE_S`` seconds (default 15) fails every rank with
  :class:`~torch_batch_process.errors.WorkerLostError` naming it;
- a rank that never joins fails the others at the join deadline, ``TBP_JOIN_TIMEOUT_S`` seconds after they
  joined (default 600: the nodes of a real cluster may start minutes apart, after an image pull or a slow
  scheduler; it is the default ``join_timeout`` of torchrun's own rendezvous), with a message naming the ranks
  that did not come.

A rank asked to stop (SIGTERM/SIGINT, :mod:`~torch_batch_process.engine.schedule.preemption`) while it waits keeps
joining: once every rank is there, the job opens and every rank returns ``preempted=True`` before its first step. But it
waits for the ranks that have not joined yet only ``TBP_HEARTBEAT_SILENCE_S`` seconds more, not until the join
deadline: a preemption usually signals every process of the job, and a rank still starting up (importing torch)
dies of it, so it never comes; the ranks then fail promptly with :class:`~torch_batch_process.errors.WorkerLostError`
(nothing was opened or written: the same command resumes).

Each step of the handshake wakes the ranks waiting for it at once: a thread of each rank waits in the store (a
blocking ``wait`` on its own connection) for the keys that end its waits, which the rank that completes a step
sets, and cuts its main loop's pause short (the loop still looks at the store every :data:`_POLL_S` at most, for the
heartbeats and deadlines). Before, a rank that had waited long slept up to :data:`_POLL_S` past each step.

Once every rank has joined, the process groups are connected with a short timeout (:func:`connect_timeout`,
at most 60 s: connecting takes well under a second per peer once everyone is there), which bounds the wait of a
rank whose peer dies in that window, and the groups then get the collective timeout
(``TBP_COLLECTIVE_TIMEOUT_S``, default 1800) for the job's own work. A group the user created is used as it is.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from torch_batch_process import settings
from torch_batch_process.errors import WorkerLostError
from torch_batch_process.settings import HEARTBEAT_S as BEAT_S
from torch_batch_process.settings import JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S

__all__ = ["JOIN_TIMEOUT_ENV", "JOIN_TIMEOUT_S", "connect_timeout", "join_job", "join_timeout_s"]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0
"""At most this long to connect the process groups once every rank has joined."""

_POLL_S = 0.1
"""The longest pause between two looks at the store while waiting (for the heartbeats, deadlines and verdicts: the
step a rank waits for ends its pause at once, :class:`_Waker`)."""

_FIRST_POLL_S = 0.002
"""The first pause after a step of the rendezvous; pauses then grow by half up to :data:`_POLL_S`, so ranks that
start together open the job in milliseconds (a fixed 0.1 s pause cost each of the 2-3 steps up to 0.1 s: a fifth of
a second on every multi-process start) and ranks that wait long poll the store ten times a second."""

_LEAD_STEPS = ("joined", "acknowledged")
"""The steps rank 0's waker waits for: every rank joined, every other rank acknowledged rank 0's ready."""

_FOLLOW_STEPS = ("ready", "go")
"""The steps another rank's waker waits for: rank 0's words."""

_LAST_CONNECT_S = 5.0
"""The store's own connect timeout when the deadline has (nearly) passed but its host was found listening."""

_TELL_S = 3.0
"""Rank 0 waits at most this long for the others to read why the job cannot open."""


def join_timeout_s() -> float:
    """Seconds a rank waits for the others to join: ``TBP_JOIN_TIMEOUT_S`` (the call's settings), default
    :data:`~torch_batch_process.settings.JOIN_TIMEOUT_S`."""
    return settings.current().join_timeout_s


def connect_timeout() -> datetime.timedelta:
    """The timeout of connecting the process groups once every rank has joined."""
    return datetime.timedelta(seconds=min(CONNECT_TIMEOUT_S, join_timeout_s()))


def join_job(
    rank: int, world_size: int, *, gpu: str | None = None, preempted: Callable[[], bool] | None = None
) -> tuple[Any, bool]:
    """Connects to the job's store and waits until every rank has joined (see the module docstring).

    Args:
        rank: this process's rank.
        world_size: the number of ranks.
        gpu: a name of this rank's GPU unique across machines (its UUID), or ``None`` without a CUDA device. NCCL
            refuses two ranks on one GPU, so a rank without a GPU, or whose GPU another rank took first, votes for
            gloo; each rank's vote is in the store before it counts as joined, so the verdict is the same on every
            rank.
        preempted: whether this rank was asked to stop (SIGTERM/SIGINT); from then on it waits for the ranks that
            have not joined yet at most the heartbeat silence (see the module docstring).

    Returns:
        The store (its timeout set to :func:`connect_timeout`), ready for ``init_process_group(store=...)``, and
        whether some rank voted for gloo (then the default group must be gloo on every rank).

    Raises:
        WorkerLostError: a rank did not join by the deadline, or joined and went silent, or rank 0's store
            cannot be reached (every rank raises, naming them).
    """
    deadline_s = join_timeout_s()
    silence_s = settings.current().heartbeat_silence_s
    patience = _Patience(preempted, silence_s, rank)
    store = _connect(rank, world_size, deadline_s, patience)
    rendezvous = _Rendezvous(store, rank, world_size, deadline_s, silence_s, patience)
    rendezvous.wait(gpu)
    store.set_timeout(connect_timeout())
    return store, rendezvous.gloo_votes() > 0


def _connect(rank: int, world_size: int, deadline_s: float, patience: _Patience) -> Any:
    """The job's TCP store: hosted by rank 0 (it does not wait for the others here: the rendezvous does, watching
    them), or by torchrun's agent when it shares its own (``TORCHELASTIC_USE_AGENT_STORE``)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = "torchrun's agent" if agent else "rank 0"
    hosting = rank == 0 and not agent
    end = time.monotonic() + deadline_s

    def unreachable(exc: BaseException) -> WorkerLostError:
        return WorkerLostError(
            f"rank {rank}: cannot reach the job's store at {addr}:{port} (hosted by {host}) within "
            f"{JOIN_TIMEOUT_ENV}={deadline_s:g} s: {host} did not start, or MASTER_ADDR/MASTER_PORT are wrong "
            f"({type(exc).__name__}: {_first_line(exc)})"
        )

    if not hosting:
        _wait_for_listener(addr, port, end, unreachable, patience)
    try:
        return dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=hosting,
            timeout=datetime.timedelta(seconds=max(end - time.monotonic(), _LAST_CONNECT_S)),
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=os.environ.get("USE_LIBUV", "1") == "1",
        )
    except Exception as exc:  # noqa: BLE001 - DistNetworkError, DistStoreError, TimeoutError, RuntimeError...
        raise unreachable(exc) from exc


def _wait_for_listener(
    addr: str,
    port: int,
    end: float,
    unreachable: Callable[[BaseException], WorkerLostError],
    patience: _Patience | None = None,
) -> None:
    """Waits until something listens at ``addr:port`` (the store's host started), until ``end`` (monotonic).

    A client ``TCPStore`` retries a failed connection once more with the whole timeout, so it alone would wait up
    to twice the join deadline for a host that never starts; this loop keeps the deadline, and the store is then
    built once its host listens (one connection opened and closed: the store's server ignores it).
    """
    pause = _Pause()
    while True:
        left = end - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(min(left, 1.0), 0.05)):
                return
        except OSError as exc:  # refused (not listening yet), timed out, no route, unknown host...
            if time.monotonic() >= end:
                raise unreachable(exc) from exc
            if patience is not None and patience.exhausted():
                raise WorkerLostError(
                    f"rank {patience.rank}: " + patience.verdict("rank 0 (the host of its store) did not start")
                ) from exc
        pause.sleep()


class _Pause:
    """The pauses of a polling loop: :data:`_FIRST_POLL_S` after each step, growing by half to :data:`_POLL_S`; a
    pause ends early when ``wake`` is set (then cleared)."""

    def __init__(self, wake: threading.Event | None = None) -> None:
        self._next = _FIRST_POLL_S
        self._wake = wake

    def reset(self) -> None:
        self._next = _FIRST_POLL_S

    def sleep(self) -> None:
        if self._wake is None:
            time.sleep(self._next)
        elif self._wake.wait(self._next):
            self._wake.clear()
        self._next = min(_POLL_S, self._next * 1.5)


class _Waker:
    """A thread that waits in the store, on a connection of its own, for each of ``keys`` in turn (blocking ``wait``:
    the store's server answers when the key is set, no polling) and sets :attr:`news` each time one is there.

    It only shortens the main loop's pauses: what the loop decides still comes from its own looks at the store.
    :meth:`close` sets the keys that are not there yet (they are this rank's own: no other rank reads them) so that
    the thread's wait returns, and joins it (for at most :data:`_TELL_S`). A failed wait (the store gone) ends the
    thread; the loop then polls.
    """

    def __init__(self, store: Any, keys: list[str], timeout_s: float) -> None:
        self.news = threading.Event()
        self._store = store
        self._keys = keys
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._thread = threading.Thread(target=self._run, name="tbp-join-waker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = self._store.clone()
            for key in self._keys:
                store.wait([key], self._timeout)
                self.news.set()
        except Exception:  # noqa: BLE001 - the store is gone or the wait ran out: the main loop finds out polling
            return

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._store.multi_set(self._keys, ["1"] * len(self._keys))
            except Exception:  # noqa: BLE001 - the store is gone: the thread's wait returns with an error
                pass
        # bounded: a store host that cannot be reached (no answer, no closed connection) would hold the thread's wait
        # until its timeout; the join's error is then not delayed by it (a daemon thread, ended by its timeout)
        self._thread.join(timeout=_TELL_S)


class _Patience:
    """How long a rank asked to stop still waits for ranks that have not joined: ``silence_s`` seconds from the first
    look after the request (see the module docstring)."""

    def __init__(self, preempted: Callable[[], bool] | None, silence_s: float, rank: int) -> None:
        self._preempted = preempted
        self.rank = rank
        self.silence_s = silence_s
        self._since: float | None = None

    def exhausted(self) -> bool:
        if self._preempted is None or not self._preempted():
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since >= self.silence_s

    def verdict(self, who: str) -> str:
        return (
            f"{who} within {self.silence_s:g} s ({_SILENCE_HINT}) of the preemption signal (SIGTERM/SIGINT) this rank "
            "received while the job was opening: the job stops without opening (nothing was written); run the same "
            "command again to resume"
        )


class _Rendezvous:
    """The wait of :func:`join_job` (one instance per call)."""

    def __init__(
        self, store: Any, rank: int, world_size: int, deadline_s: float, silence_s: float, patience: _Patience
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.deadline_s = deadline_s
        self.silence_s = silence_s
        self.patience = patience
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"tbp_join/{restart}/"  # torchrun's agent store may serve several rounds
        self._stop = threading.Event()
        self._wake: threading.Event | None = None

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _wake_key(self, rank: int, step: str) -> str:
        """The key that ends ``rank``'s wait for ``step`` of the handshake (rank 0: ``joined``, every rank joined;
        ``acknowledged``, every other rank acknowledged; another rank: ``ready`` and ``go``, rank 0's words)."""
        return self._key(f"wake/{rank}/{step}")

    def _waker_timeout_s(self) -> float:
        """The longest a waker waits in the store: past the longest a follower waits (its loop ends the join before)."""
        return self.deadline_s + 2 * self.silence_s + 60.0

    def _wake_rank0(self, step: str) -> None:
        self._request(lambda: self.store.set(self._wake_key(0, step), "1"))

    def _wake_others(self, step: str) -> None:
        """Rank 0: wakes every other rank for ``step`` (one request)."""
        keys = [self._wake_key(r, step) for r in self._others()]
        if keys:
            self._request(lambda: self.store.multi_set(keys, ["1"] * len(keys)))

    def gloo_votes(self) -> int:
        """Ranks that voted for gloo (final once :meth:`wait` returned: every rank votes before it joins)."""
        return int(self._request(lambda: self.store.add(self._key("gloo_votes"), 0)))

    def wait(self, gpu: str | None = None) -> None:
        started = time.monotonic()
        shared = gpu is not None and self._request(lambda: self.store.add(self._key(f"gpu/{gpu}"), 1)) > 1
        self._request(lambda: self.store.add(self._key("gloo_votes"), int(gpu is None or shared)))  # before joined
        self._request(lambda: self.store.add(self._key(f"beat/{self.rank}"), 1))  # joined: beating before counted
        # cuts this rank's pauses short when the step it waits for is there (started before this rank counts as
        # joined, which may complete rank 0's first step)
        steps = _LEAD_STEPS if self.rank == 0 else _FOLLOW_STEPS
        waker = _Waker(self.store, [self._wake_key(self.rank, step) for step in steps], self._waker_timeout_s())
        self._wake = waker.news
        try:
            if self._request(lambda: self.store.add(self._key("joined"), 1)) == self.world_size:
                self._wake_rank0("joined")  # the last rank to join: rank 0 says ready at once
            beater = threading.Thread(target=self._beat, name="tbp-join-heartbeat", daemon=True)
            beater.start()
            try:
                if self.rank == 0:
                    self._lead(started)
                else:
                    self._follow(started)
            finally:
                self._stop.set()
                beater.join()  # no thread of the join outlives it
        finally:
            waker.close()
        logger.debug("rank %d: every rank joined in %.2f s", self.rank, time.monotonic() - started)

    def _beat(self) -> None:
        try:
            store = self.store.clone()  # a connection of its own: the main thread polls on the other
        except Exception:  # noqa: BLE001 - the store is gone: the main thread finds out
            return
        while not self._stop.wait(BEAT_S):
            try:
                store.add(self._key(f"beat/{self.rank}"), 1)
            except Exception:  # noqa: BLE001
                return

    def _lead(self, started: float) -> None:
        """Rank 0: waits for every rank to join, then for every other rank to acknowledge that it saw them all
        (a rank that died just before the last one joined is then caught here, not in the groups' connection),
        watching the heartbeats of those that joined."""
        watch = _Silence(self.silence_s)
        next_scan = 0.0
        ready = False
        pause = _Pause(self._wake)
        while True:
            if not ready:
                joined = self._request(lambda: self.store.add(self._key("joined"), 0))
                if joined >= self.world_size:
                    self._request(lambda: self.store.set(self._key("ready"), "1"))
                    self._wake_others("ready")
                    ready = True
                    pause.reset()
            if ready and self._request(lambda: self.store.add(self._key("acknowledged"), 0)) >= self.world_size - 1:
                self._request(lambda: self.store.set(self._key("go"), "1"))
                self._wake_others("go")
                return
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + BEAT_S
                beats = {
                    r: self._request(lambda r=r: self.store.add(self._key(f"beat/{r}"), 0)) for r in self._others()
                }
                silent = watch.update(beats, now)
                if silent:
                    self._fail(
                        f"rank(s) {silent} joined the job and then stopped while it was opening (no heartbeat for "
                        f"{self.silence_s:g} s, {_SILENCE_HINT}): the process died or hangs; see its log",
                        waiting=sum(1 for r, count in beats.items() if count > 0 and r not in silent),
                    )
                if not ready and self.patience.exhausted():
                    missing = [r for r, count in beats.items() if count == 0]
                    self._fail(
                        self.patience.verdict(f"rank(s) {missing} did not join the job"),
                        waiting=self.world_size - 1 - len(missing),
                    )
                if now - started >= self.deadline_s:
                    missing = [r for r, count in beats.items() if count == 0]
                    self._fail(
                        f"rank(s) {missing} did not join the job within {JOIN_TIMEOUT_ENV}={self.deadline_s:g} s "
                        f"({self.world_size - len(missing)} of {self.world_size} ranks joined): start every rank (with "
                        f"the same MASTER_ADDR and MASTER_PORT), or raise {JOIN_TIMEOUT_ENV} when nodes start further "
                        "apart",
                        waiting=self.world_size - 1 - len(missing),
                    )
            pause.sleep()

    def _follow(self, started: float) -> None:
        """Any other rank: acknowledges rank 0's word that every rank joined, waits for its go (or its verdict),
        watching rank 0's heartbeat."""
        watch = _Silence(self.silence_s)
        next_scan = 0.0
        acknowledged = False
        pause = _Pause(self._wake)
        while True:
            if not acknowledged and self._request(lambda: self.store.check([self._key("ready")])):
                if self._request(lambda: self.store.add(self._key("acknowledged"), 1)) == self.world_size - 1:
                    self._wake_rank0("acknowledged")  # the last to acknowledge: rank 0 says go at once
                acknowledged = True
                pause.reset()
            if acknowledged and self._request(lambda: self.store.check([self._key("go")])):
                return
            if self._request(lambda: self.store.check([self._key("failed")])):
                message = self._request(lambda: self.store.get(self._key("failed"))).decode("utf-8", "replace")
                self._request(lambda: self.store.add(self._key("told"), 1))
                raise WorkerLostError(f"rank {self.rank}: {message}")
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + BEAT_S
                beat = self._request(lambda: self.store.add(self._key("beat/0"), 0))
                if watch.update({0: beat}, now):
                    raise WorkerLostError(
                        f"rank {self.rank}: rank 0 stopped while the job was opening (no heartbeat for "
                        f"{self.silence_s:g} s, {_SILENCE_HINT}): the process died or hangs; see its log"
                    )
                if not acknowledged and self.patience.exhausted():  # rank 0 waits for ranks that do not come
                    verdict = self.patience.verdict("not every rank joined the job")
                    raise WorkerLostError(f"rank {self.rank}: {verdict}")
                if now - started >= self.deadline_s + 2 * self.silence_s:  # rank 0 would have given its verdict
                    raise WorkerLostError(
                        f"rank {self.rank}: the job did not open within {JOIN_TIMEOUT_ENV}={self.deadline_s:g} s "
                        "(rank 0 never said that every rank joined)"
                    )
            pause.sleep()

    def _others(self) -> range:
        return range(1, self.world_size)

    def _fail(self, message: str, waiting: int) -> None:
        """Rank 0: tells every rank why the job cannot open, and raises it. The store lives in this process (unless
        torchrun's agent hosts it): it waits a moment for the ``waiting`` ranks to read the verdict, so that they
        raise it rather than a lost store."""
        try:
            self.store.set(self._key("failed"), message)
            for step in _FOLLOW_STEPS:  # the others look at once (their loop reads the verdict, not these keys)
                self._wake_others(step)
            until = time.monotonic() + _TELL_S
            while self.store.add(self._key("told"), 0) < waiting and time.monotonic() < until:
                time.sleep(_POLL_S)
        except Exception:  # noqa: BLE001 - the others find out when the store goes with this process
            pass
        raise WorkerLostError(f"rank 0: {message}")

    def _request(self, call: Any) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - the store's host is gone (rank 0's process, or the agent)
            raise WorkerLostError(
                f"rank {self.rank}: the job's store (hosted by rank 0 or torchrun's agent) stopped answering while "
                f"the job was opening: rank 0 died or its machine is unreachable ({type(exc).__name__}: "
                f"{_first_line(exc)})"
            ) from exc


class _Silence:
    """Which watched ranks' heartbeat counters have not moved for ``silence_s`` seconds (a rank that has not
    joined yet, counter 0, is not silent: the deadline is for it)."""

    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_scan: float | None = None

    def update(self, beats: dict[int, int], now: float) -> list[int]:
        if self._last_scan is not None and now - self._last_scan > self.silence_s / 2:
            self._seen.clear()  # this process did not run for a while (suspended, starved): a fresh grace for all
        self._last_scan = now
        silent = []
        for rank, count in beats.items():
            last = self._seen.get(rank)
            if last is None or count != last[0]:
                self._seen[rank] = (count, now)
            elif count > 0 and now - last[1] >= self.silence_s:
                silent.append(rank)
        return silent


_SILENCE_HINT = "TBP_HEARTBEAT_SILENCE_S"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
