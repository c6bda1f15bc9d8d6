"""The connector's worker half: ``worker`` (KVReelWorker: moves pages between
vLLM's cache and the tiers), ``block_copy`` (pages <-> host tensors),
``reports`` (what the worker tells the scheduler) and ``fetch`` (remote chunks:
transfer, choice of form, decode)."""
