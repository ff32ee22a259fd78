"""The checks the boundaries share (policy file, public constructors, trace files, every path
hicache opens).

``check_int(value, name, lo=1, hi=None, error=ValueError)``: ``value`` when it is an int (never a
bool, which Python counts as one) in ``[lo, hi]``; otherwise ``error`` with one line naming
``name``, the range and what was given. Internal code trusts what a boundary checked.

``regular_file(path, what, error=OSError)``: ``stat`` before ``open``. True for a regular file,
False when nothing is there; a FIFO, socket, device or directory is ``error`` with one line
(opening a FIFO blocks until a writer comes, a device may never end: never a hang).

``system_dir(path)``: the pseudo-filesystem (``/proc``, ``/sys``, ``/dev``) ``path`` resolves
into, or None: no store or report is ever written there.
"""

from __future__ import annotations

import os
import stat
from typing import Any

SYSTEM_DIRS = ("/proc", "/sys", "/dev")


def int_range(lo: int = 1, hi: int | None = None) -> str:
    """How an int range reads in an error: "a positive int", "a non-negative int", "an int >= 2",
    "an int in [a, b]"."""
    if hi is not None:
        return f"an int in [{lo}, {hi}]"
    return {0: "a non-negative int", 1: "a positive int"}.get(lo, f"an int >= {lo}")


def check_int(value: Any, name: str, lo: int = 1, hi: int | None = None,
              error: type[Exception] = ValueError) -> int:
    """``value`` if it is an int (not a bool) with ``lo <= value <= hi``; else raise ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo \
            or (hi is not None and value > hi):
        raise error(f"{name} must be {int_range(lo, hi)}, got {value!r:.40}")
    return value


def file_kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a character device"
            if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a special file")


def regular_file(path: str | os.PathLike, what: str,
                 error: type[Exception] = OSError) -> bool:
    """True when ``path`` (symlinks followed) is a regular file, False when there is nothing;
    anything else (FIFO, socket, device, directory) raises ``error`` naming ``path`` and what it
    is, before anything opens it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise error(f"{path}: cannot stat {what}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} must be a regular file, but this is "
                    f"{file_kind(st.st_mode)}")
    return True


def system_dir(path: str | os.PathLike) -> str | None:
    """The system directory ``path`` resolves into (symlinks followed), or None."""
    real = os.path.realpath(path)
    return next((d for d in SYSTEM_DIRS if real == d or real.startswith(d + "/")), None)
