"""What hicache does before the interpreter finalizes, so that a process that ends with caches
still open and its process group never destroyed (a script stopped by an uncaught error) exits
with its Python status, never by a signal.

Why it is needed: once ``Py_FinalizeEx`` has begun (CPython before 3.14), a thread that takes
the GIL is ended by ``pthread_exit``; ended that way inside a C++ ``noexcept`` frame (any
destructor), it calls ``std::terminate``: SIGABRT, "terminate called without an active
exception". Two kinds of threads take the GIL from such frames:

- a collective backend's worker thread (gloo's ``ProcessGroupGloo::runLoop``) drops its
  reference to a finished work moments AFTER ``wait()`` returned on the caller's thread; the
  work's tensors then give up their Python objects (``TensorImpl::decref_pyobject`` takes the
  GIL). Under load that thread may not run before the caller has raised, printed its traceback
  and begun finalizing (the abort's stack: ``runLoop`` -> ``~AsyncAllreduceWork`` ->
  ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``);
- our own threads (L2 copy workers, the L3 writer) inside a torch call, whose binding takes the
  GIL back in a destructor when the call returns.

So every tensor hicache hands to a collective goes through :func:`lend`: a fresh alias of it
that only the backend holds once the call returns, so that alias's Python object lives exactly
as long as the backend's reference. One ``atexit`` hook (it runs before finalization, the
interpreter intact) first closes every cache still open (:func:`close_at_exit`: local, no
collective, so a peer that is gone cannot hang it; its threads stop, its L3 writes land), then
waits, releasing the GIL, until the backends have let go of every lent tensor (at most
``EXIT_WAIT_S``: a collective that never completes cannot hold the exit; an alias Python itself
still holds, e.g. in the frames of a traceback raised out of a collective, also waits it out).
"""

from __future__ import annotations

import atexit
import itertools
import sys
import time
import weakref
from typing import Any

import torch

EXIT_WAIT_S = 2.0  # the most the exit waits for the backends to let go of lent tensors
_POLL_S = 0.001

_LENT: dict[int, weakref.ref] = {}  # key -> alias a backend may still hold
_OPEN: dict[int, weakref.ref] = {}  # key -> object whose ``_close_at_exit`` runs at exit
_KEYS = itertools.count()


def lend(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` (same storage, so results land in ``t``) to hand to a collective: the
    exit waits until no backend holds it. Cheap (one detach and a weak reference)."""
    alias = t.detach()
    key = next(_KEYS)
    _LENT[key] = weakref.ref(alias, lambda _ref, key=key: _LENT.pop(key, None))
    return alias


def held() -> int:
    """How many lent tensors a backend (or a caller) still holds."""
    return len(_LENT)


def drain(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Wait, releasing the GIL, until no lent tensor is held (at most ``timeout_s``); True when
    none is."""
    deadline = time.monotonic() + timeout_s
    while _LENT and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return not _LENT


def close_at_exit(obj: Any) -> None:
    """Call ``obj._close_at_exit()`` at interpreter exit if ``obj`` is still alive then (a weak
    reference: it never keeps ``obj`` alive). The method must be local (no collective) and
    do nothing once ``obj`` is closed."""
    key = next(_KEYS)
    _OPEN[key] = weakref.ref(obj, lambda _ref, key=key: _OPEN.pop(key, None))


def _at_exit() -> None:
    for ref in list(_OPEN.values()):
        obj = ref()
        if obj is None:
            continue
        try:
            obj._close_at_exit()
        except Exception as err:  # the exit goes on; say what was not closed cleanly
            print(f"hicache: closing {type(obj).__name__} at exit failed: {err!r}",
                  file=sys.stderr)
    drain()


atexit.register(_at_exit)
