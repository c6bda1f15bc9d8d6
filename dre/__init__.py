"""The DRE (dynamic retrieval engine): clusters a long session's history keys
off the engine's critical path, in its own process (``service``), reached over
``wire`` through ``client``; ReSV's hash-bit clusters (``resv``) and Mosaic's
nested k-means (``mosaic``). Imports nothing of ``kvreel.connector``."""
