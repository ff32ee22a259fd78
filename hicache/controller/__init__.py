"""Cache controller: radix tree over widened pages, policies, cross-rank agreement."""

from hicache.controller.agreement import AgreedStep, StepAgreement
from hicache.controller.controller import CacheController, LockHandle
from hicache.controller.policy import EVICTION_POLICIES, WRITE_POLICIES
from hicache.controller.snapshots import SnapshotSettings
from hicache.controller.tree import Node, RadixTree, as_tokens
from hicache.controller.types import BackupOp, ControllerStats, InsertResult, LoadOp, Match

__all__ = ["AgreedStep", "BackupOp", "CacheController", "ControllerStats", "EVICTION_POLICIES",
           "InsertResult", "LoadOp", "LockHandle", "Match", "Node", "RadixTree", "SnapshotSettings",
           "StepAgreement", "WRITE_POLICIES", "as_tokens"]
