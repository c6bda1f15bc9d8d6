"""Fetch-control building blocks: resolution/format choice, bandwidth estimate, the shaper."""

import time

import pytest

from kvreel.connector.worker_side.fetch.adaptive import BandwidthEstimator, Candidate, choose
from bench.shaper import Shaper

VIDEO = [Candidate("video@256", 4_000_000, 0.030), Candidate("video@512", 3_600_000, 0.020),
         Candidate("raw", 9_000_000, 0.002)]


def test_slow_link_fetches_the_smallest_form():
    best, costs = choose(VIDEO, bandwidth_Bps=125e6)          # 1 Gbps: transmission dominates
    assert best.name == "video@512"
    assert costs["video@512"] == pytest.approx(3_600_000 / 125e6)


def test_fast_link_or_busy_decoders_fetch_raw():
    assert choose(VIDEO, bandwidth_Bps=5e9)[0].name == "raw"          # 40 Gbps: decoders are the bottleneck
    assert choose(VIDEO, bandwidth_Bps=500e6, decoder_load=8)[0].name == "raw"


def test_switching_penalty_keeps_the_previous_resolution_when_close():
    two = VIDEO[:2]
    assert choose(two, 125e6)[0].name == "video@512"
    assert choose(two, 125e6, previous="video@256", switch_penalty_s=0.01)[0].name == "video@256"


def test_bandwidth_estimate_falls_at_once_and_rises_slowly():
    est = BandwidthEstimator(100e6, alpha=0.5)
    est.observe(50_000_000, 1.0)              # the link slowed down: believed at the first transfer
    assert est.Bps == pytest.approx(50e6)
    est.observe(150_000_000, 1.0)             # faster again: half way there
    assert est.Bps == pytest.approx(100e6)
    est.observe(0, 1.0)                       # nothing moved: no evidence
    assert est.Bps == pytest.approx(100e6)
    with pytest.raises(ValueError):
        BandwidthEstimator(0)


def test_a_slowed_link_switches_to_the_smaller_form_at_the_next_chunk():
    est = BandwidthEstimator(5e9)             # a fast link: raw wins
    assert choose(VIDEO, est.Bps)[0].name == "raw"
    est.observe(900_000, 0.01)                # one transfer at 90 MB/s
    assert choose(VIDEO, est.Bps)[0].name == "video@512"


def _echo_server():
    import socket
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        conn, _ = srv.accept()
        n = int(conn.recv(64).decode())
        conn.sendall(bytes(range(256)) * (n // 256))
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_shaper_limits_throughput_and_passes_bytes_unchanged():
    import socket
    srv = _echo_server()
    n = 2_000_000
    rate = 4e6                      # 4 MB/s: 2 MB cannot arrive in under ~0.45 s (64 KiB burst)
    with Shaper(srv.getsockname(), rate_Bps=rate) as proxy:
        c = socket.create_connection(("127.0.0.1", proxy.port))
        t0 = time.monotonic()
        c.sendall(str(n).encode())
        got = bytearray()
        while len(got) < n:
            part = c.recv(1 << 16)
            if not part:
                break
            got += part
        dt = time.monotonic() - t0
        c.close()
    srv.close()
    assert bytes(got) == bytes(range(256)) * (n // 256)
    assert dt >= (n - 64 * 1024) / rate * 0.95


def test_token_bucket_passes_sends_larger_than_its_burst_at_the_set_rate():
    from bench.shaper import TokenBucket
    bucket = TokenBucket(rate_Bps=4e6, burst=64 * 1024)
    t0 = time.monotonic()
    for _ in range(8):
        bucket.take(256 * 1024)            # 4x the burst: must not wait forever
    dt = time.monotonic() - t0
    assert (8 * 256 * 1024 - 64 * 1024) / 4e6 * 0.9 <= dt < 2.0


def test_shaper_replays_a_trace_set_while_running():
    srv = _echo_server()
    with Shaper(srv.getsockname(), rate_Bps=1e9) as proxy:
        proxy.trace = [(0.2, 1e6), (0.2, 3e6)]
        seen = set()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not {1e6, 3e6} <= seen:
            seen.add(proxy.bucket.rate)
            time.sleep(0.01)
        assert {1e6, 3e6} <= seen
        proxy.trace = []
        time.sleep(0.3)
        proxy.bucket.set_rate(7e6)
        time.sleep(0.3)
        assert proxy.bucket.rate == 7e6            # a cleared trace no longer overrides the rate
    srv.close()
