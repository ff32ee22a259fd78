"""The controller's write and eviction policy: the policy file's ``[policy]`` section.

Choices, defaults and ranges are the policy file's (``hicache.config.PolicySection``), so a
controller built from keyword arguments accepts exactly what the policy file accepts."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from hicache.config import HiCacheConfig, PolicySection
from hicache.errors import ConfigError

_FIELDS = {f.name: f for f in dataclasses.fields(PolicySection)}
WRITE_POLICIES: tuple[str, ...] = _FIELDS["write"].metadata["choices"]
EVICTION_POLICIES: tuple[str, ...] = _FIELDS["eviction"].metadata["choices"]
# what the controller reads; the section's other fields (L3 prefetch, cost model) are the service's
SETTINGS = ("write", "eviction", "selective_threshold", "load_back_threshold")


def controller_policy(policy: PolicySection | None, settings: Mapping[str, Any]) -> PolicySection:
    """``policy`` (default: the policy file's defaults) with ``settings`` replacing fields of
    ``SETTINGS``, validated by the policy file's own rules; ConfigError otherwise."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown controller setting(s) {unknown}; expected some of {SETTINGS}")
    if policy is None and not settings:
        return PolicySection()
    if policy is not None and not isinstance(policy, PolicySection):
        raise ConfigError(f"policy must be a PolicySection (HiCacheConfig.policy), got "
                          f"{type(policy).__name__}")
    values = dataclasses.asdict(policy) if policy is not None else {}
    values.update(settings)
    try:
        return HiCacheConfig.from_dict({"policy": values}).policy
    except ConfigError as e:
        raise ConfigError(str(e)) from None
