"""The connector's scheduler half (vLLM's scheduler process): ``kvreel_scheduler``
(KVReelScheduler, the coordinator), ``chunks`` (index, tier budgets, eviction),
``loads``/``saves``/``prefetch`` (a step's plans), ``events`` (tier changes as
vLLM's KV events), ``requests``, ``workflow`` (agent-workflow hints) and
``history_plan`` (long sessions' offload plan)."""
