"""kvreel.scheduler: fetch control for remote KV."""
