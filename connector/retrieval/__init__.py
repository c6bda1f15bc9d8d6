"""Retrieval for long sessions: cluster the offloaded KV and attend only to the
clusters that matter (ReSV hash-bit clustering + WiCSum; Mosaic)."""
