"""Cache controller: radix tree over widened pages, policies, cross-rank agreement."""

from hicache.controller.agreement import AgreedStep, AgreementError, DivergenceError, StepAgreement
from hicache.controller.controller import CacheController, InvariantError, LockHandle
from hicache.controller.policy import EVICTION_POLICIES, WRITE_POLICIES, PolicyError
from hicache.controller.tree import Node, RadixTree, as_tokens
from hicache.controller.types import (BackupOp, ControllerError, ControllerStats,
                                      DeviceFullError, InsertResult, LoadOp, LockError, Match,
                                      PageOwnershipError, StaleNodeError, TokenTypeError,
                                      UnknownOpError)

__all__ = [
    "AgreedStep", "AgreementError", "BackupOp", "CacheController", "ControllerError",
    "ControllerStats", "DeviceFullError", "DivergenceError", "EVICTION_POLICIES",
    "InsertResult", "InvariantError", "LoadOp", "LockError", "LockHandle", "Match", "Node",
    "PageOwnershipError", "PolicyError", "RadixTree", "StaleNodeError", "StepAgreement",
    "TokenTypeError", "UnknownOpError", "WRITE_POLICIES", "as_tokens",
]
