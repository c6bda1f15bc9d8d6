"""Remote-tier transport faults, through the loopback shaper in front of a real
Redis: every one ends in a bounded time as a failed load (recompute), never a hang."""

import socket
import time

import pytest
import torch

from bench.shaper import Shaper
from kvreel.codec.formats import ChunkUnavailable, chunk_key
from kvreel.codec.forms import StoredForms
from kvreel.connector.tiers.remote import RemoteTier
from kvreel.scheduler.remote_lookups import RemoteLookups

ID = "model-r"
HASHES = [bytes([i]) * 32 for i in range(4)]
KEY = chunk_key(HASHES)


def payload():
    return torch.randint(0, 256, (2, 4, 64 * 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


def url(port):
    return f"redis://:s3cret@127.0.0.1:{port}/0"


def test_write_behind_drains_on_close_and_round_trips(redis_server):
    _, port = redis_server
    tier = RemoteTier(url(port), StoredForms(ID), timeout_s=2, queue_size=8)
    data = payload()
    assert tier.put(KEY, HASHES, data)
    tier.close()                                          # a clean shutdown flushes the queue
    reader = RemoteTier(url(port), StoredForms(ID), timeout_s=2, queue_size=8)
    assert torch.equal(reader.get(KEY), data)
    reader.close()
    lookups = RemoteLookups(url(port), ID, timeout_s=2)
    deadline = time.monotonic() + 5
    while (found := lookups.poll("r", HASHES + [b"\xee" * 32])) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert found == [(KEY, row) for row in range(4)]
    lookups.close()


def test_lookups_are_waited_for_a_bounded_time_per_scheduler_step(redis_server):
    """A store that answers within the step's wait costs a new request no
    scheduler step; a hung one costs one step at most the wait, and is not
    waited for again until a lookup answers in time."""
    _, port = redis_server
    up = RemoteTier(url(port), StoredForms(ID), timeout_s=2, queue_size=8)
    up.put(KEY, HASHES, payload())
    up.close()
    lookups = RemoteLookups(url(port), ID, timeout_s=2, wait_s=2.0)
    lookups.new_step()
    assert lookups.poll("r", HASHES) == [(KEY, row) for row in range(4)]       # answered in the same step
    lookups.close()
    with socket.socket() as hung:                        # accepts connections, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        lookups = RemoteLookups(f"redis://127.0.0.1:{hung.getsockname()[1]}/0", ID, timeout_s=1, wait_s=0.2)
        lookups.new_step()
        t0 = time.monotonic()
        assert lookups.poll("a", HASHES) is None
        assert lookups.poll("b", HASHES) is None         # the step's wait is spent
        assert 0.2 <= time.monotonic() - t0 < 0.5
        lookups.new_step()
        t0 = time.monotonic()
        assert lookups.poll("c", HASHES) is None         # a slow store is not waited for
        assert time.monotonic() - t0 < 0.05
        deadline = time.monotonic() + 10
        while (found := lookups.poll("a", HASHES)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found == [] and lookups.errors == 1       # the timed-out lookup: nothing held remotely
        lookups.close()


@pytest.mark.parametrize("fault", ["cut mid-chunk", "too slow for the timeout"])
def test_transport_faults_fail_the_load_in_bounded_time(redis_server, fault):
    _, port = redis_server
    up = RemoteTier(url(port), StoredForms(ID), timeout_s=2, queue_size=8)
    up.put(KEY, HASHES, payload())
    up.close()
    kw = {"cut_after_bytes": 100_000} if fault == "cut mid-chunk" else {}
    rate = 1e9 if fault == "cut mid-chunk" else 20_000          # 20 kB/s: 512 KiB needs ~26 s
    with Shaper(("127.0.0.1", port), rate_Bps=rate, **kw) as proxy:
        tier = RemoteTier(url(proxy.port), StoredForms(ID), timeout_s=0.5, queue_size=2)
        t0 = time.monotonic()
        with pytest.raises(ChunkUnavailable, match="remote store"):
            tier.get(KEY)
        assert time.monotonic() - t0 < 5
        tier.close(drain_timeout_s=1)
