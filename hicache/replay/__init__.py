"""``hicache replay``: the real cache controller driven by a production trace, without a model.

sizes.py (capacities: tokens, bytes for a model, or a share of the trace), keys.py (page
chain keys and decode fillers), offline.py (the infinite-cache ideal and the offline
furthest-next-use reference), l3.py (the L3 tier as a capacity-bounded page set), sim.py
(arrivals, in-flight requests, the controller's tiers), command.py (the CLI, table, JSON, plot).
"""

from .sim import ReplayResult, ReplaySettings, replay  # noqa: F401
