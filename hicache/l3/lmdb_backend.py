"""The LMDB backend's registration: ``[l3.lmdb]`` keys, preflight, error meaning, test fixture.

The store itself is :class:`hicache.l3.store.PageStore`; it (and ``lmdb``) is imported only when a
store is opened or checked, never by importing this module.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import registry
from ..checks import system_dir
from ..config import opt
from ..errors import ConfigError, L3CorruptError, L3Error, L3ForeignError

DEFAULT_CAPACITY = 1 << 30


@dataclass(frozen=True)
class LmdbSection:
    path: str = opt("hicache-l3", "environment directory (one per node, shared by its ranks)")
    size_bytes: int = opt(DEFAULT_CAPACITY, "store capacity in bytes (LRU eviction beyond)",
                          min=1 << 20, max=1 << 50)
    check_on_open: bool = opt(False, "walk the whole store in a child process before opening "
                                     "it (a damaged store then disables L3, never the server)")


def open_store(section: LmdbSection, namespace, rank: int, *, writer: bool = True,
               capacity_bytes: int | None = None, timeout_s: float | None = None, **options):
    from .store import PageStore
    del timeout_s  # a local store has no network bound
    return PageStore(section.path, namespace, rank, capacity_bytes or section.size_bytes,
                     writer=writer, **options)


def check_path(path: str) -> None:
    """The directory must be a directory, or creatable, outside /proc, /sys and /dev."""
    key = "l3.lmdb.path"
    if not path or not path.strip():
        raise ConfigError(f"{key}: is empty; give the LMDB directory")
    if "\0" in path:
        raise ConfigError(f"{key}: {path!r} contains a NUL character")
    d = system_dir(path)
    if d is not None:
        raise ConfigError(f"{key}: {path!r} is under {d}, not a place for a store")
    p = Path(os.path.realpath(path))
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{key}: {path!r} exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: directory {path!r} is not writable")
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}: {path!r} cannot be created: {str(parent)!r} is not a "
                          "directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {path!r} cannot be created: {str(parent)!r} is not writable")


def check_store(path: str) -> list[str]:
    """An existing store: refuse another application's environment (ConfigError); a damaged
    one is a warning (the run continues without L3). Nothing is mapped before the file checks."""
    from . import lmdb_check
    try:
        if lmdb_check.precheck(path) is None:
            return []
    except L3CorruptError as e:
        return [f"l3.lmdb.path: the store is damaged ({e}); the run continues without L3; "
                f"`hicache l3 check {path} --quarantine` moves it aside"]
    import lmdb
    try:
        env = lmdb.open(path, readonly=True, max_dbs=8, subdir=True)
    except lmdb.Error as e:
        return [f"l3.lmdb.path: the store cannot be opened ({e}); the run continues without L3"]
    try:
        lmdb_check.check_owner(env, path)
    except L3ForeignError as e:
        raise ConfigError(f"l3.lmdb.path: {e}") from None
    finally:
        env.close()
    return []


def preflight(section: LmdbSection, page_bytes: int) -> list[str]:
    check_path(section.path)
    if section.size_bytes < page_bytes:
        raise ConfigError(f"l3.lmdb.size_bytes: {section.size_bytes} is smaller than one page "
                          f"shard ({page_bytes} bytes per rank)")
    return check_store(section.path)


def errors() -> tuple:
    import lmdb
    return (L3Error, lmdb.Error, OSError)


def classify(e: BaseException) -> str:
    import lmdb
    if isinstance(e, (L3CorruptError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                      lmdb.InvalidError, lmdb.VersionMismatchError)):
        return "corrupt"
    if isinstance(e, (lmdb.DiskError, lmdb.MapFullError, lmdb.TxnFullError)) or (
            isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)):
        return "full"
    if isinstance(e, (PermissionError, lmdb.ReadonlyError)) or (
            isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM)):
        return "auth"
    if isinstance(e, (L3ForeignError, lmdb.IncompatibleError)):
        return "refused"
    return "other"


def before_open(section: LmdbSection) -> str | None:
    """``check_on_open``: walk the store in a child process; the reason L3 is off, or None."""
    if not section.check_on_open:
        return None
    from . import lmdb_check
    report = lmdb_check.check_in_child(str(section.path))
    if report.get("foreign"):
        raise L3ForeignError(report["error"])
    if not report.get("ok"):
        return report.get("error") or f"{report.get('bad_values')} damaged values"
    return None


def _tamper(store, key: bytes) -> None:
    with store._env.begin(write=True, db=store._data) as txn:
        data = bytearray(txn.get(key))
        data[len(data) // 2] ^= 0xFF
        txn.put(key, bytes(data))


def _raw_put(store, key: bytes, value: bytes) -> None:
    """An outsider with the directory writes ``value`` (head | payload as the store lays them
    out) under ``key`` (LRU bookkeeping left alone: a planted value needs none to be found)."""
    head, data = value[:store._head_len], value[store._head_len:]
    with store._env.begin(write=True) as txn:
        txn.put(key, data, db=store._data)
        txn.put(key, head, db=store._head)


@contextmanager
def fixture(scratch: str):
    yield registry.StoreFixture({"path": os.path.join(scratch, "lmdb"), "size_bytes": 64 << 20},
                                _tamper, _raw_put)


@contextmanager
def scratch(section: LmdbSection):
    """An empty store of its own in a fresh directory beside ``path`` (removed afterwards)."""
    import shutil
    import tempfile
    base = Path(section.path)
    base.parent.mkdir(parents=True, exist_ok=True)
    d = tempfile.mkdtemp(prefix=base.name + ".cold-", dir=base.parent)
    try:
        yield {"path": d}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def claims(where) -> bool:
    return isinstance(where, os.PathLike) or (isinstance(where, str) and "://" not in where)


RECORD = b"ns:"  # meta sub-database: RECORD + namespace digest -> Namespace.record()
_PREFIX = 18  # namespace digest (16 B) | rank (2 B): the part of a key no secret changes
_PURGE_BATCH = 4096  # keys deleted per write transaction
_PURGE_ROOM = 64 << 20  # map room past the file a purge opens with (grown on MapFullError)


@contextmanager
def _env(path: str, writer: bool):
    """The environment on an existing store (this process's shared one when a store is open
    on it); L3Error when ``path`` holds none."""
    from .store import _acquire_env, _release_env
    data = os.path.join(os.fspath(path), "data.mdb")
    if not os.path.isfile(data):
        raise L3Error(f"{path!r} holds no LMDB store (no data.mdb)")
    size = max(os.path.getsize(data), 1 << 20)
    # a writer (purge) needs free pages past the file's end: a delete copies the pages it
    # changes before the old ones are free, and a map the size of the file has none
    room = size + max(_PURGE_ROOM, size // 4) if writer else size
    shared = _acquire_env(os.fspath(path), room, room, writer, True)
    try:
        yield shared
    finally:
        _release_env(shared)


def _txn(shared, fn, write: bool):
    import lmdb
    for _ in range(4):
        grow = False
        with shared.gate.shared():
            try:
                with shared.env.begin(write=write, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                pass
            except lmdb.MapFullError:
                if not write:
                    raise
                grow = True
        with shared.gate.exclusive():
            # adopt the size another process set, or (a full map) double it
            shared.env.set_mapsize(2 * shared.env.info()["map_size"] if grow else 0)
    raise L3Error(f"L3 store {shared.path!r} keeps being resized by other processes")


def scan(section: LmdbSection) -> registry.Scan:
    """Walk the keys (not the values) of the store: pages and bytes per namespace and rank,
    and the namespace records. Costs one read transaction over the ``head`` index."""
    def fn(txn):
        sh = shared
        pages: dict = {}
        cur = txn.cursor(db=sh.head)
        for k, head in cur:
            k = bytes(k)
            data = txn.get(k, db=sh.data)
            key = (k[:16], int.from_bytes(k[16:_PREFIX], "big"))
            n, b = pages.get(key, (0, 0))
            pages[key] = (n + 1, b + len(head) + (len(data) if data is not None else 0))
        records = {}
        cur = txn.cursor(db=sh.meta)
        if cur.set_range(RECORD):
            for k, v in cur:
                k = bytes(k)
                if not k.startswith(RECORD):
                    break
                records[k[len(RECORD):]] = bytes(v)
        return registry.Scan(pages, records)

    with _env(section.path, writer=False) as shared:
        return _txn(shared, fn, write=False)


def purge(section: LmdbSection, digest: bytes, rank: int | None) -> tuple[int, int]:
    """Delete the pages under ``digest`` (and ``rank``), in write transactions of a few
    thousand keys (ranks writing meanwhile wait for each), then the record."""
    prefix = digest + (rank.to_bytes(2, "big") if rank is not None else b"")
    total = [0, 0]

    def fn(txn):
        sh = shared
        cur = txn.cursor(db=sh.head)
        keys = []
        if cur.set_range(prefix):
            for k in cur.iternext(keys=True, values=False):
                k = bytes(k)
                if not k.startswith(prefix) or len(keys) >= _PURGE_BATCH:
                    break
                keys.append(k)
        freed = 0
        for k in keys:
            for db in (sh.data, sh.head):
                v = txn.get(k, db=db)
                if v is not None:
                    freed += len(v)
                    txn.delete(k, db=db)
            stamp = txn.get(k, db=sh.atime)
            if stamp is not None:
                txn.delete(bytes(stamp) + k, db=sh.lru)
                txn.delete(k, db=sh.atime)
        used = int.from_bytes(bytes(txn.get(b"used", db=sh.meta) or b""), "big")
        txn.put(b"used", max(used - freed, 0).to_bytes(8, "big"), db=sh.meta)
        if rank is None and len(keys) < _PURGE_BATCH:
            txn.delete(RECORD + digest, db=sh.meta)
        total[0] += len(keys)
        total[1] += freed
        return len(keys)

    with _env(section.path, writer=True) as shared:
        while _txn(shared, fn, write=True) >= _PURGE_BATCH:
            pass
    return total[0], total[1]


def usage(store) -> registry.Usage:
    """The whole environment: pages (entries of its ``head`` index), bytes held (the
    environment's own ``used`` counter) and capacity (``size_bytes``); two read transactions."""
    return registry.Usage(store.num_pages(), store.used_bytes(), store.capacity_bytes)


BACKEND = registry.register(registry.Backend(
    name="lmdb", section=LmdbSection, open=open_store, preflight=preflight, errors=errors,
    classify=classify, fixture=fixture, shared=False, describe=lambda s: str(s.path),
    claims=claims, section_of=lambda where: {"path": os.fspath(where)},
    before_open=before_open, scratch=scratch, scan=scan, purge=purge, usage=usage))
