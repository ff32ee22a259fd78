"""Checks of an LMDB L3 store that run before (or instead of) mapping it.

LMDB maps ``data.mdb`` and trusts it: a file shorter than the environment's last page faults
(SIGBUS) when a page past the end is touched, damaged B-tree pages can crash the reader (SIGSEGV),
a damaged meta page makes the environment unopenable. So:

- :func:`precheck` reads the two meta pages with plain reads (no mapping) and checks magic,
  version, page size, root page numbers and the file size against the last page in use;
- :func:`check_owner` refuses an environment whose main database holds anything but hicache's
  sub-databases (another application's store);
- :func:`deep_check` walks every record of every sub-database and verifies every value's
  checksum; :func:`check_in_child` runs it in a child process, so a crash there is a verdict
  ("damaged") instead of the end of the caller; :func:`quarantine` moves a damaged store aside.

This module imports only lmdb, msgpack, xxhash and the standard library: the child runs it as a
script (``python lmdb_check.py PATH``) without importing torch.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

from hicache.checks import regular_file
from hicache.errors import L3CorruptError, L3ForeignError

HICACHE_DBS = frozenset({b"data", b"head", b"atime", b"lru", b"meta"})
MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
P_META = 0x08
P_INVALID = (1 << 64) - 1
_META = struct.Struct("<QHHHH" + "II" + "QQ" + "IHHQQQQQ" * 2 + "QQ")  # page header + MDB_meta


def checksum(key: bytes, buf) -> bytes:
    """XXH3-64 of a value seeded with the key's own XXH3-64 (as the store writes it)."""
    import xxhash
    return xxhash.xxh3_64_digest(buf, seed=xxhash.xxh3_64_intdigest(key))


def _meta(raw: bytes, index: int, where: str) -> dict:
    if len(raw) < _META.size:
        raise L3CorruptError(f"{where}: meta page {index} is cut short ({len(raw)} bytes)")
    v = _META.unpack_from(raw)
    pgno, flags, magic, version = v[0], v[2], v[5], v[6]
    if magic != MAGIC or not flags & P_META or pgno != index:
        raise L3CorruptError(f"{where}: meta page {index} is damaged (magic {magic:#x}, "
                             f"page {pgno}, flags {flags:#x})")
    if version != DATA_VERSION:
        raise L3CorruptError(f"{where}: meta page {index} has LMDB data version {version}, "
                             f"expected {DATA_VERSION}")
    free, main = v[9:17], v[17:25]  # MDB_db: pad (page size in FREE_DBI), flags, depth, ...
    return {"psize": free[0], "mapsize": v[8], "free_root": free[7], "main_root": main[7],
            "main_entries": main[6], "depth": (free[2], main[2]), "last_pg": v[25],
            "txnid": v[26]}


def precheck(path: str) -> dict | None:
    """Check ``path/data.mdb`` without mapping it; None when there is no store yet. Returns the
    meta LMDB would use; raises ``L3CorruptError`` naming what is wrong."""
    data = os.path.join(path, "data.mdb")
    for name in ("data.mdb", "lock.mdb"):  # stat before open: a FIFO would block the open
        regular_file(os.path.join(path, name), f"the L3 store's {name}", L3CorruptError)
    if not os.path.lexists(data):
        return None
    where = data
    try:
        with open(data, "rb") as f:
            st = os.fstat(f.fileno())
            if not (st.st_mode & 0o170000 == 0o100000):
                raise L3CorruptError(f"{where}: not a regular file")
            size = st.st_size
            if size == 0:  # created, not yet written: another process's LMDB is initialising
                return None  # it under its lock (LMDB makes an empty file a new store)
            head = f.read(_META.size)
            m0 = _meta(head, 0, where)
            psize = m0["psize"]
            if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
                raise L3CorruptError(f"{where}: meta page 0 gives page size {psize}")
            f.seek(psize)
            m1 = _meta(f.read(_META.size), 1, where)
    except OSError as e:
        raise L3CorruptError(f"{where}: cannot read: {e.strerror or e}") from None
    if size < 2 * psize:
        raise L3CorruptError(f"{where}: {size} bytes, shorter than the two meta pages")
    use = m0 if m0["txnid"] >= m1["txnid"] else m1
    for i, m in enumerate((m0, m1)):
        last = m["last_pg"]
        for name in ("free_root", "main_root"):
            root = m[name]
            if root != P_INVALID and not 2 <= root <= last:
                raise L3CorruptError(f"{where}: meta page {i}: {name.replace('_', ' ')} {root} is "
                                     f"outside the pages in use [2, {last}]")
        if max(m["depth"]) > 64:
            raise L3CorruptError(f"{where}: meta page {i}: B-tree depth {max(m['depth'])}")
        if m["mapsize"] and (last + 1) * psize > m["mapsize"]:
            raise L3CorruptError(f"{where}: meta page {i}: last page {last} is past the map size "
                                 f"{m['mapsize']}")
    need = (use["last_pg"] + 1) * psize
    if size < need:
        raise L3CorruptError(f"{where}: truncated: {size} bytes but the environment's last page "
                             f"({use['last_pg']}) ends at byte {need}")
    return use


def check_owner(env, path: str) -> None:
    """Raise ``L3ForeignError`` when the main database of an open environment holds names
    other than hicache's sub-databases (another application's store)."""
    with env.begin() as txn:
        names = [bytes(k) for k, _ in txn.cursor()]
    foreign = [n for n in names if n not in HICACHE_DBS]
    if foreign:
        shown = ", ".join(repr(n)[1:] for n in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise L3ForeignError(f"L3 path {path!r} holds an LMDB environment that is not a "
                             f"hicache store (its main database has {shown}); give hicache a "
                             "directory of its own")


def _good(k: bytes, head, value, secrets) -> bool | None | str:
    """A value's checksum or MAC holds (None: a MAC that no secret was given to verify;
    ``"mac"``: a well-formed value whose MAC no given secret verifies)."""
    import hmac

    import msgpack
    raw = bytes(head)
    h = msgpack.unpackb(raw)
    if value is None or len(value) != h["n"]:
        return False
    if "xxh" in h:
        return checksum(k, value) == h["xxh"]
    if secrets is None:
        return None
    tag, prefix = h["mac"], raw[:-len(h["mac"])]
    return any(hmac.compare_digest(tag, s.tag(k, prefix, value)) for s in secrets.all) or "mac"


def deep_check(path: str, secrets=None) -> dict:
    """Walk every record of every sub-database and verify every value: its checksum, or its
    MAC when ``secrets`` (:class:`hicache.l3.auth.Secrets`) are given; authenticated values are
    counted as ``unverified`` without them (in this process: a damaged B-tree can crash it; see
    :func:`check_in_child`)."""
    import lmdb
    report = {"path": path, "ok": False, "entries": {}, "values": 0, "bad_values": 0,
              "unverified": 0, "mac_values": 0, "mac_failures": 0, "error": None}
    meta = precheck(path)
    if meta is None:
        report.update(ok=True, error=None, note="no store yet")
        return report
    try:  # a reader slot: a consistent snapshot while ranks write
        env = lmdb.open(path, readonly=True, max_dbs=8, subdir=True)
    except lmdb.Error:  # no usable lock file (a copied store): read without one
        env = lmdb.open(path, readonly=True, max_dbs=8, subdir=True, lock=False)
    try:
        check_owner(env, path)
        with env.begin(buffers=True) as txn:
            dbs = {n: env.open_db(n, txn=txn, create=False)
                   for n in HICACHE_DBS if txn.get(n) is not None}
            for name, db in dbs.items():
                n = sum(1 for _ in txn.cursor(db=db))
                if n != txn.stat(db)["entries"]:
                    raise L3CorruptError(f"{name.decode()}: {n} records walked but the B-tree "
                                         f"says {txn.stat(db)['entries']}")
                report["entries"][name.decode()] = n
            if b"head" in dbs and b"data" in dbs:
                for key, head in txn.cursor(db=dbs[b"head"]):
                    report["values"] += 1
                    k = bytes(key)
                    value = txn.get(k, db=dbs[b"data"])
                    try:
                        good = _good(k, head, value, secrets)
                    except Exception:
                        good = False
                    if good is None:
                        report["unverified"] += 1
                    else:
                        report["bad_values"] += good is not True
                        report["mac_values"] += good is True or good == "mac"
                        report["mac_failures"] += good == "mac"
    finally:
        env.close()
    report["ok"] = report["bad_values"] == 0
    # every MAC fails and nothing else does: the secret given is not the store's (no damage)
    report["wrong_secret"] = bool(report["mac_values"]) and \
        report["mac_failures"] == report["mac_values"] == report["bad_values"]
    return report


def _signame(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def check_in_child(path: str, timeout_s: float = 600.0,
                   secret_files: tuple[str, str] | None = None) -> dict:
    """:func:`deep_check` in a child process; a crash or a timeout is a "damaged" verdict.
    ``secret_files`` (current, previous; "" for none) verify MACs; None: the environment's
    (``$HICACHE_L3_SECRET_FILE``, ``$HICACHE_L3_PREVIOUS_SECRET_FILE``)."""
    cmd = [sys.executable, os.path.abspath(__file__), path]
    env = dict(os.environ)
    if secret_files is not None:
        env["HICACHE_L3_SECRET_FILE"], env["HICACHE_L3_PREVIOUS_SECRET_FILE"] = secret_files
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"path": path, "ok": False, "error": f"the check took over {timeout_s:g} s"}
    if r.returncode < 0:
        return {"path": path, "ok": False,
                "error": f"reading the store crashed the check with {_signame(-r.returncode)} "
                         "(damaged pages)"}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"path": path, "ok": False, "error": f"the check failed: {tail}"}


def quarantine(path: str) -> str:
    """Move a damaged store aside (``PATH.damaged-<time>``); returns the new path."""
    dest = f"{path.rstrip(os.sep)}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while os.path.exists(dest + (f".{n}" if n else "")):
        n += 1
    dest += f".{n}" if n else ""
    os.rename(path, dest)
    return dest


def _main(path: str) -> None:
    import lmdb

    from hicache.errors import ConfigError
    from hicache.l3 import auth
    try:
        secrets = auth.load(None)
    except ConfigError as e:
        print(json.dumps({"path": path, "ok": False, "usage": True, "error": str(e)}))
        return
    try:
        report = deep_check(path, secrets)
        report["mac_verified"] = secrets is not None
    except (L3CorruptError, L3ForeignError, lmdb.Error) as e:
        report = {"path": path, "ok": False, "foreign": isinstance(e, L3ForeignError),
                  "error": f"{type(e).__name__}: {e}" if isinstance(e, lmdb.Error) else str(e)}
    print(json.dumps(report))


if __name__ == "__main__":
    _main(sys.argv[1])
