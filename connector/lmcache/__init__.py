"""kvreel inside LMCache: its remote store and video codec as LMCache plugins.

* ``l2_adapter.KVReelL2Adapter`` + the ``kvreel`` serde (``serde``): LMCache's
  multiprocess mode (``lmcache server --l2-adapter '{"type": "plugin", ...}'``).
* ``remote_connector.KVReelConnectorAdapter``: in-process LMCache through
  ``remote_storage_plugins``.

Needs the ``lmcache`` package; nothing else in kvreel imports this.
"""
