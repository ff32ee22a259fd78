"""Token ids and page ids as numpy arrays (int64; the radix tree's tokens int32): the one
coercion of each.

Every layer that takes ids from a caller (controller, service, L3 keys, page allocator,
transfer engine) converts them here, so all accept the same types and refuse the same inputs:
a list, tuple or range of ints (one C conversion, ``array('q')``), a numpy integer array, an
integer tensor, or any object with an integer buffer (``array('q')``, a memoryview). Arrays,
CPU tensors and buffers are viewed, not copied, where their dtype allows. A bool is never an id.
This module imports no other part of hicache (tiers and the controller both use it).
"""

from __future__ import annotations

import array

import numpy as np
import torch

from hicache.errors import UsageError

_INT_FORMATS = frozenset("bBhHiIlLqQnN")  # struct codes of integer buffers
_BOOLS = frozenset((bool, np.bool_))
INT64 = np.dtype(np.int64)  # native int64: hot paths test a dtype by identity (another int64
                           # spelling, e.g. big-endian, is not this object: the general path)


def _from_list(values: list, error: type[Exception], what: str) -> np.ndarray:
    """Python ints as int64 [n]: one C conversion, then a check for bools; ``error`` names
    the first bad element otherwise."""
    try:
        arr = np.frombuffer(array.array("q", values), np.int64)
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is not None:  # array('q') takes a bool as 0/1: refuse bools here
        if len(values) <= 256:  # one C scan of the types beats numpy's fixed cost
            if _BOOLS.isdisjoint(map(type, values)):
                return arr
        else:  # only elements equal to 0 or 1 could be False or True
            small = np.flatnonzero((arr >> 1) == 0)
            if not any(isinstance(values[i], (bool, np.bool_)) for i in small.tolist()):
                return arr
    for t in values:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise error(f"{what} must be ints: {type(t).__name__} {t!r} is not an int")
        if not -(1 << 63) <= t < (1 << 63):
            raise error(f"{what} must be ints: {t!r} is out of the int64 range")
    raise error(f"{what} must be ints")  # not reached: array('q') refused one of them


def _int_array(ids, error: type[Exception], what: str) -> np.ndarray:
    """``ids`` as a numpy integer array of any int dtype and shape (viewed where possible)."""
    tp = type(ids)
    if tp is np.ndarray:
        arr = ids
    elif tp is list:
        return _from_list(ids, error, what)
    elif isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise error(f"{what} must be integers, got a {ids.dtype} tensor")
        arr = ids.detach().cpu().numpy()
    elif isinstance(ids, np.ndarray):
        arr = ids
    elif isinstance(ids, (tuple, range)):
        return _from_list(list(ids), error, what)
    elif isinstance(ids, (str, bytes, bytearray)) or ids is None:
        raise error(f"{what} must be a list, tensor, numpy array or integer buffer, got "
                    f"{type(ids).__name__}")
    else:
        try:
            mv = memoryview(ids)
        except TypeError:
            raise error(f"{what} must be a list, tensor, numpy array or integer buffer, got "
                        f"{type(ids).__name__}") from None
        if mv.format.lstrip("@=<>!") not in _INT_FORMATS:
            raise error(f"{what} must be integers, got a buffer of format {mv.format!r}")
        arr = np.asarray(mv)
    if arr.dtype.kind not in "iu":
        raise error(f"{what} must be integers, got dtype {arr.dtype}")
    return arr


def as_tokens(tokens, int64: bool = True) -> np.ndarray:
    """Token ids as a 1-D numpy integer array; UsageError for anything else.

    ``int64=False`` keeps another integer dtype; ``int64=True`` converts to int64 where
    needed (the radix tree's form is ``tree_tokens``)."""
    if type(tokens) is np.ndarray and tokens.dtype is INT64 and tokens.ndim == 1:
        return tokens  # the hot path
    arr = _int_array(tokens, UsageError, "tokens")
    if arr.ndim != 1:
        raise UsageError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if int64 and arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    return arr


TOKEN = np.dtype(np.int32)  # how the radix tree keeps token ids: every vocabulary fits, and
TOKEN_BYTES = TOKEN.itemsize  # half of int64's bytes to copy, compare and hold
TOKEN_MIN, TOKEN_MAX = int(np.iinfo(TOKEN).min), int(np.iinfo(TOKEN).max)
_ONE_TOKEN = (TOKEN_BYTES,)  # the strides of a 1-D contiguous token array


def tree_tokens(tokens) -> np.ndarray:
    """Token ids as the radix tree keeps them: a C-contiguous 1-D int32 array, the caller's own
    where it already is one (then nothing is copied), else a converted copy; UsageError naming
    the first id outside int32 (and what ``as_tokens`` refuses)."""
    if type(tokens) is np.ndarray and tokens.dtype is TOKEN and tokens.strides == _ONE_TOKEN:
        return tokens  # the hot path (1-D, contiguous): what HiCache hands the controller
    arr = as_tokens(tokens, int64=False)
    if arr.dtype is not TOKEN:
        dt = arr.dtype
        if arr.size and not (dt.itemsize < 4 or (dt.itemsize == 4 and dt.kind == "i")):
            lo, hi = TOKEN_MIN, TOKEN_MAX
            bad = np.flatnonzero((arr < lo) | (arr > hi))
            if bad.size:
                i = int(bad[0])
                raise UsageError(f"token {i} is {int(arr[i])}: token ids must fit int32 "
                                 f"([{lo}, {hi}]; the cache keeps them so)")
        arr = arr.astype(TOKEN)
    return np.ascontiguousarray(arr)


def join_ids(parts: "list[np.ndarray]") -> np.ndarray:
    """int64 id arrays [k_i] end to end, as a new writable int64 array [sum k_i]: one C join of
    their bytes (``np.concatenate`` costs about 0.25 us more per part); a part that is not one
    contiguous buffer takes numpy's path. TypeError if a part is not an array (e.g. None)."""
    try:
        return np.frombuffer(bytearray().join(parts), INT64)
    except TypeError:  # a strided part, or not an array at all
        if not all(isinstance(p, np.ndarray) for p in parts):
            raise
        return np.concatenate(parts)


def page_ids(pages, what: str = "page ids") -> np.ndarray:
    """Page ids as a flat int64 array [k], viewed when already int64; UsageError naming ``what``
    otherwise (the range check against a pool is the pool's)."""
    if type(pages) is np.ndarray and pages.dtype is INT64 and pages.ndim == 1:
        return pages  # the hot path: what the controller hands out
    try:
        arr = _int_array(pages, UsageError, what)
    except UsageError as e:
        raise UsageError(f"{e} (integer page ids)") from None
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.dtype != np.int64:
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
            raise UsageError(f"{what} include {int(arr.max())}, out of the int64 range")
        arr = arr.astype(np.int64)
    return arr
