"""The parts of the engine's facade, ``hicache.service.HiCache``, that are not its request
flow: the request records (``request``), the agreed construction and close (``lifecycle``) and
the stats it reports (``report``)."""
