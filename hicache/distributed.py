"""torch.distributed plumbing shared by the engine, the cache and the tests.

- ``launch(world_size, fn, *args)`` spawns real processes (gloo on CPU, nccl on GPU), runs
  ``fn(rank, world_size, *args)`` in each and returns every rank's result (picklable). When a
  rank fails (an exception, a signal, an exit) the others are stopped and ``RankError`` names
  the rank and how. Always bounded by a timeout; ranks exit without interpreter teardown.
- Collective wrappers that feature-detect names that moved between torch 2.11 and 2.13.
- ``agree_min(header, payload, group, code=, kind=)``: the control plane's MIN all-reduce
  (per-step agreement, close, checkpoints, PCP checks, L3 restore lengths, prefetch agreement),
  on CPU tensors over ``control_group``: one fixed-size vector for every kind
  (``hicache.minvec``), so ranks whose payload lengths differ, that report bad input, or that
  are in agreements of different kinds (``KindMismatch``) still send the same size and every
  rank learns it after the collective.
  ``min_across_ranks(values, group)`` is its plain form (raises ``DivergenceError`` on every
  rank when the lengths differ).
- ``CollectiveCounter`` counts collectives issued, so tests can assert "exactly one per step".
- ``control_group(group)``: the group the CPU control plane (per-step agreement, L3 MIN,
  benchmark flags) talks over: ``group`` itself when its backend takes CPU tensors (gloo), else a
  gloo group over the same ranks, created once beside it (NCCL takes only CUDA tensors), named
  after ``group`` so its members agree on the name whatever other groups each rank made.
"""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache import minvec
from hicache.at_exit import lend
from hicache.errors import DivergenceError, RankError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(rank: int, world_size: int, port: int, backend: str | None = None,
                       timeout_s: float = 120.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def local_world_size() -> int:
    """Ranks sharing this host's memory: LOCAL_WORLD_SIZE (torchrun, ``launch``), else one per
    visible GPU up to the world size, else 1."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if torch.cuda.is_available() and dist.is_available() and dist.is_initialized():
        return max(1, min(torch.cuda.device_count(), dist.get_world_size()))
    return 1


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown: C++ threads (gloo, torch) destroyed during Python's
    finalization abort the process ("terminate called without an active exception")."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _worker(rank: int, world_size: int, port: int, backend: str | None, timeout_s: float,
            fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # every rank runs on this host
    os.environ["LOCAL_RANK"] = str(rank)
    code, port_taken = 0, False
    try:
        try:
            init_process_group(rank, world_size, port, backend, timeout_s)
        except Exception as e:  # rank 0's store could not listen: another process took the port
            port_taken = rank == 0 and _port_in_use(e)
            raise
        result = fn(rank, world_size, *args)
        # pickled here: tensors would otherwise travel as shared memory that dies with us
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        code = 1
        line = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        try:
            cause = pickle.dumps(e)
            pickle.loads(cause)
        except Exception:
            cause = None
        queue.put((rank, None if port_taken else False, (line, traceback.format_exc(), cause)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                code = code or 1
    _exit_now(code)


def _port_in_use(err: BaseException) -> bool:
    """The group's store failed to listen because its port was taken (between ``free_port``
    and the listen, another process bound it)."""
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _how_it_died(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (the kernel's OOM killer sends SIGKILL: out of memory?)" \
            if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode} without a result"


def launch(world_size: int, fn: Callable, *args: Any, backend: str | None = None,
           timeout_s: float = 120.0, grace_s: float = 2.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; results by rank.

    ``fn`` must be importable (module level). When a rank fails (raises, is killed, exits),
    the others are stopped within ``grace_s`` and ``launch`` raises ``RankError`` naming the
    rank that failed first and how: a rank that died without a word (a signal, an exit code)
    is the cause over ranks that merely lost their peer. Nothing hangs past ``timeout_s``.
    A store port another process took before rank 0 listened on it starts the ranks again
    on a fresh port (``PORT_TRIES`` times at most; no rank has run ``fn`` then).
    """
    for attempt in range(PORT_TRIES):
        reports = _run_once(world_size, fn, args, backend, timeout_s, grace_s)
        if not (reports.port_taken and attempt + 1 < PORT_TRIES):
            return _results_or_raise(reports, world_size, timeout_s)
    raise AssertionError("unreachable")


PORT_TRIES = 3


def _run_once(world_size: int, fn: Callable, args: tuple, backend: str | None,
              timeout_s: float, grace_s: float) -> "_Reports":
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, fn, args,
                                               queue), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    reports = _Reports(queue)
    timed_out = _watch(procs, reports, world_size, timeout_s, grace_s)
    _stop(procs, kill=bool(reports.errors or reports.deaths or timed_out))
    reports.drain()
    return reports


class _Reports:
    """What the ranks of one ``launch`` reported so far, by rank."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self.results: dict[int, Any] = {}
        # rank -> (line, traceback, pickled exception), in arrival order
        self.errors: dict[int, tuple] = {}
        # rank -> exit code of a rank that left without reporting
        self.deaths: dict[int, int] = {}
        self.port_taken = False  # rank 0's store found its port taken (launch tries again)

    def drain(self) -> None:
        """Take every message the ranks have sent."""
        while not self.queue.empty():
            rank, ok, payload = self.queue.get()
            if ok:
                self.results[rank] = pickle.loads(payload)
            else:
                self.errors[rank] = payload
                self.port_taken |= ok is None

    def heard_from(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors or rank in self.deaths


def _watch(procs: list, reports: _Reports, world_size: int, timeout_s: float,
           grace_s: float) -> bool:
    """Collect the ranks' reports until each has reported or died, ``grace_s`` after the
    first failure, or past the timeout; True when it timed out."""
    start = time.monotonic()
    failed_at = None
    while len(reports.results) + len(reports.errors) + len(reports.deaths) < world_size:
        reports.drain()
        exited = [r for r, p in enumerate(procs)
                  if p.exitcode is not None and not reports.heard_from(r)]
        if exited:
            reports.drain()  # a message sent just before exiting
            for r in exited:
                if r not in reports.results and r not in reports.errors:
                    reports.deaths[r] = procs[r].exitcode
        if (reports.errors or reports.deaths) and failed_at is None:
            failed_at = time.monotonic()
        now = time.monotonic()
        if failed_at is not None and now - failed_at > grace_s:
            break
        if now - start > timeout_s + 60.0:
            return True
        time.sleep(0.01)
    return False


def _stop(procs: list, kill: bool) -> None:
    """Join every rank; ``kill``: first stop the survivors (they would wait on a dead peer
    until the timeout)."""
    for p in procs:
        if p.is_alive() and kill:
            p.kill()
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _results_or_raise(reports: _Reports, world_size: int, timeout_s: float) -> list:
    """The results by rank, or RankError for the rank that failed first (a death before an
    error, an error before a missing result)."""
    if reports.deaths:
        rank = min(reports.deaths)
        raise RankError(rank, _how_it_died(reports.deaths[rank]))
    if reports.errors:
        rank = next(iter(reports.errors))
        line, detail, cause = reports.errors[rank]
        try:
            exc = pickle.loads(cause) if cause else None
        except Exception:
            exc = None
        raise RankError(rank, f"failed: {line}", detail, exc)
    results = reports.results
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RankError(missing[0], f"returned no result within {timeout_s:g} s (timed out); "
                                    f"ranks without a result: {missing}")
    return [results[r] for r in range(world_size)]


# ---- collectives, feature-detected -----------------------------------------------------------
class CollectiveCounter:
    """Counts the collectives hicache issues (wrappers below call ``bump``)."""

    count = 0

    @classmethod
    def bump(cls) -> None:
        cls.count += 1

    @classmethod
    @contextmanager
    def measure(cls):
        start = cls.count
        box = {"n": 0}
        try:
            yield box
        finally:
            box["n"] = cls.count - start


def _first(*names: str):
    """The first collective of these names this torch has (2.13 renamed some of 2.11's)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"this torch.distributed has none of {names}")


# torch 2.13 deprecates *_into_tensor / *_tensor in favour of *_single; 2.11 has only the former.
_ALL_GATHER = _first("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_REDUCE_SCATTER = _first("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    CollectiveCounter.bump()
    _ALL_GATHER(lend(out), lend(inp), group=group)


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    CollectiveCounter.bump()
    _REDUCE_SCATTER(lend(out), lend(inp), group=group)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    CollectiveCounter.bump()
    dist.all_to_all_single(lend(out), lend(inp), group=group)


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    CollectiveCounter.bump()
    dist.all_reduce(lend(t), op=op, group=group)


class AgreedMin(NamedTuple):
    """What :func:`agree_min` agreed; identical on every rank."""
    fault: tuple[int, int] | None   # (rank, code) of the lowest rank that reported a fault
    length: tuple[int, int]         # (min, max) over ranks of the payload's length
    header: list[int]               # the header, MIN over ranks
    payload: list[int] | None       # the payload, MIN over ranks; None unless ``agreed``

    @property
    def agreed(self) -> bool:
        return self.payload is not None


class KindMismatch(DivergenceError):
    """Ranks met in agreements of different kinds (``minvec.KINDS``): raised by
    :func:`agree_min` on every rank, after the one collective (every kind sends one size)."""

    def __init__(self, kind: int, rank: int, other: int, other_rank: int,
                 fault: tuple[int, int] | None, where: str = "") -> None:
        super().__init__(f"{where + ': ' if where else ''}rank {other_rank} is in {minvec.kind_name(other)} while this rank "
                         f"(rank {rank}) is in {minvec.kind_name(kind)}; every rank stops here")
        self.kind, self.rank, self.other, self.other_rank = kind, rank, other, other_rank
        self.fault = fault


def agree_min(header: Sequence[int], payload: Sequence[int], group=None, *, code: int = 0,
              kind: int = minvec.PLAIN) -> AgreedMin:
    """MIN over ``group`` of a fixed-size ``header`` and a payload whose length may differ
    between ranks (when it does, nothing is reduced and every rank learns it), on CPU int64
    tensors over :func:`control_group`. ``code`` (1..255, 0: none; 1 is taken for a value
    that is not an int64) reports this rank's bad input instead of raising before the
    collective: every rank gets the lowest faulty rank and its code. ``kind``
    (``minvec.KINDS``) names the agreement: ranks in different kinds raise ``KindMismatch``
    (a ``DivergenceError`` naming both) on every rank. Every kind sends ONE all-reduce of the
    same size, ``5 + minvec.HEADER_SLOTS + minvec.CAPACITY`` values (the header padded; one
    longer than ``HEADER_SLOTS`` is a ``ValueError`` of the calling code), and a second of the
    agreed size only when every rank's payload is longer than the capacity (see
    :mod:`hicache.minvec`). Alone: nothing is communicated."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        p = minvec.pack(header, payload, rank=0, code=code, capacity=len(payload), kind=kind,
                        header_slots=minvec.HEADER_SLOTS)
        u = minvec.unpack(p.vec.tolist(), minvec.HEADER_SLOTS, len(payload))
        return AgreedMin(u.fault, u.length, u.header[:len(header)],
                         u.head if u.agreed else None)
    return agree_min_on(control_group(group), dist.get_rank(group), header, payload, code=code,
                        kind=kind)


def agree_min_on(ctl, rank: int, header: Sequence[int], payload: Sequence[int], *,
                 code: int = 0, kind: int = minvec.PLAIN) -> AgreedMin:
    """:func:`agree_min` over a control group already resolved (``control_group(group)``, of
    two ranks or more) as group rank ``rank``: the per-step path, with no group look-ups."""
    p = minvec.pack(header, payload, rank=rank, code=code, kind=kind,
                    header_slots=minvec.HEADER_SLOTS)
    # the tensors wrap the packed buffers (no copy): the all-reduce leaves its MIN in them
    all_reduce(torch.frombuffer(p.vec, dtype=torch.int64), op=dist.ReduceOp.MIN, group=ctl)
    u = minvec.unpack(p.vec.tolist(), minvec.HEADER_SLOTS)
    if not u.agreed:
        if not u.same_kind:  # before any second collective: no rank sends one
            other, other_rank = u.other_kind(kind)
            raise KindMismatch(kind, rank, other, other_rank, u.fault)
        return AgreedMin(u.fault, u.length, u.header[:len(header)], None)
    body = u.head
    if u.overflow:  # every rank saw the same reduced lengths: the same size everywhere
        all_reduce(torch.frombuffer(p.rest, dtype=torch.int64), op=dist.ReduceOp.MIN,
                   group=ctl)
        body = body + p.rest.tolist()
    return AgreedMin(None, u.length, u.header[:len(header)], body)


def min_across_ranks(values: Sequence[int], group=None, *, kind: int = minvec.PLAIN
                     ) -> list[int]:
    """Element-wise MIN of the ints ``values`` over ``group`` (a MAX rides along as
    ``-MIN(-x)``): :func:`agree_min` with no header, so one small all-reduce of a CPU int64
    tensor (no GPU sync). Ranks passing different numbers of values, or a value that is not an
    int64, or ranks in another kind of agreement, make EVERY rank raise ``DivergenceError``
    (never a mismatched collective). Alone (no process group, or a group of one) nothing is
    communicated."""
    res = agree_min((), values, group, kind=kind)
    if res.agreed:
        return res.payload
    if res.fault is not None:
        rank, _ = res.fault
        raise DivergenceError(f"min_across_ranks: rank {rank} passed a value that is not an "
                              f"int64 ({len(values)} values here)")
    lo, hi = res.length
    raise DivergenceError(f"min_across_ranks: ranks passed between {lo} and {hi} values "
                          f"(this rank {len(values)}); the callers diverged")


def all_gather_object(obj: Any, world_size: int, group=None) -> list:
    """Every rank's ``obj``, gathered over :func:`control_group` (pickled control data: a CPU
    collective with the group's timeout, never a device round trip through NCCL). Pickled here
    rather than by ``dist.all_gather_object`` so that every tensor the backend holds is
    :func:`~hicache.at_exit.lend`-ed: the lengths, then the pickles padded to the longest."""
    CollectiveCounter.bump()
    ctl = control_group(group)
    data = pickle.dumps(obj)
    lengths = torch.zeros(world_size, dtype=torch.int64)
    _ALL_GATHER(lend(lengths), lend(torch.tensor([len(data)], dtype=torch.int64)), group=ctl)
    width = int(lengths.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(world_size * width, dtype=torch.uint8)
    _ALL_GATHER(lend(everyone), lend(mine), group=ctl)
    flat = everyone.numpy()
    return [pickle.loads(flat[r * width:r * width + n].tobytes())
            for r, n in enumerate(lengths.tolist())]


# ---- the control plane's CPU group -----------------------------------------------------------
_CONTROL: dict[int, tuple] = {}  # id(group) -> (group, its gloo twin)


def rank0_decides(local: bool, group=None) -> bool:
    """Rank 0's ``local`` on every rank of ``group`` (a CPU flag over its control group, so
    over a gloo twin under NCCL); without a group, ``local``."""
    if group is None:
        return local
    flag = torch.tensor([int(local)])
    dist.broadcast(lend(flag), src=0, group=control_group(group))
    return bool(flag.item())


def device_types(group=None) -> set[str]:
    """Device types whose tensors ``group``'s backend accepts ({"cuda"} for NCCL)."""
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)  # torch >= 2.2
    if types is not None:
        return {torch.device(t).type for t in types}
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cuda:nccl,cpu:gloo"
        return {part.split(":")[0] for part in backend.split(",")}
    return {"cpu", "cuda"} if backend == "gloo" else {"cuda"}


def group_timeout(group=None) -> datetime.timedelta | None:
    """``group``'s collective timeout where this torch exposes it, else None (torch default)."""
    pg = group if group is not None else dist.group.WORLD
    for dev in sorted(device_types(pg)):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout
        except Exception:
            continue
    return None


def group_name(group=None) -> str | None:
    """The name torch registered ``group`` under (its store prefix): the same on every member,
    which rendezvoused under it; None where this torch does not say."""
    pg = group if group is not None else dist.group.WORLD
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return names.get(pg) if isinstance(names, dict) else None


_NAMING = threading.Lock()


def _new_group_named(ranks: list[int], name: str | None, **kwargs):
    """``dist.new_group`` whose name (and so store prefix) is ``name``, not the one torch would
    derive from how many groups this process made before (which ranks need not agree on: a
    mismatch hangs the rendezvous). Falls back to torch's naming where it cannot be set."""
    c10d = dist.distributed_c10d
    derive = getattr(c10d, "_process_group_name", None)
    taken = name is None or name in getattr(getattr(c10d, "_world", None), "pg_names", {}).values()
    if derive is None or taken:
        return dist.new_group(ranks, **kwargs)
    with _NAMING:
        c10d._process_group_name = lambda *a, **k: name
        try:
            return dist.new_group(ranks, **kwargs)
        finally:
            c10d._process_group_name = derive


def control_group(group=None):
    """A group over ``group``'s ranks that takes CPU tensors: ``group`` itself when it does,
    else a gloo group created beside it on the first call (collective: every member of
    ``group`` calls this) and reused after. The twin is named after ``group``, so the members
    agree on its name however many other groups each of them created before."""
    pg = group if group is not None else dist.group.WORLD
    if "cpu" in device_types(pg):
        return group
    hit = _CONTROL.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    kwargs: dict[str, Any] = {"backend": "gloo", "timeout": group_timeout(pg)}
    if "use_local_synchronization" in inspect.signature(dist.new_group).parameters:
        kwargs["use_local_synchronization"] = True  # only the members take part
    parent = group_name(pg)
    ctl = _new_group_named(dist.get_process_group_ranks(pg),
                           None if parent is None else f"hicache-control:{parent}", **kwargs)
    _CONTROL[id(pg)] = (pg, ctl)
    return ctl
