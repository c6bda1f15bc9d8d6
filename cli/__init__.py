"""The ``kvreel`` command: ``serve`` (vLLM's server with kvreel connected),
``demo``, ``doctor``, ``settings``, ``inspect`` and the DRE service (``main``)."""
