"""KV events: what the cache holds, published in vLLM's wire format for routers (``wire``: the
event classes; ``publisher``: the ZMQ publisher and its replay socket; ``tiers``: tier changes
turned into events)."""
