"""Damaged chunks and broken disks inside a real vLLM engine: never a wrong
token, always a recompute, counted and logged."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

from conftest import run_scenario, tokens
from kvreel.codec.formats import ChunkError
from kvreel.connector.tiers.disk import scan_chunk_files

pytestmark = pytest.mark.vllm

P = tokens(600, 1)
OTHER = tokens(300, 7)


def _corrupt_payloads(disk: str) -> str:
    # Flip one byte near the end of every chunk file: headers stay valid, so the
    # restarted engine indexes the chunks and reports hits; the CRC catches it at load.
    return ("shell:python -c \"import glob,os\n"
            f"for p in glob.glob('{disk}/*/rank0/*/*.kvr'):\n"
            "    f=open(p,'r+b'); f.seek(os.path.getsize(p)-100); b=f.read(1); f.seek(-1,1)\n"
            "    f.write(bytes([b[0]^0xFF])); f.close()\"")


def test_corruption_found_after_lookup_hit_is_recomputed(tiny_model, tmp_path):
    disk = str(tmp_path / "disk")
    cfg = {"cpu_bytes": "64MiB", "disk_dir": disk}
    cold = run_scenario({"model": tiny_model, "phases": [{"prompts": [P]}]})
    reel = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [
        {"prompts": [P]},
        {"before": "restart", "prompts": [OTHER]},   # new engine indexes the (still valid) files
        {"before": _corrupt_payloads(disk), "prompts": [P]},
        # the bad chunks are forgotten; P's blocks were stored anew from the recompute
        {"before": "reset_prefix_cache", "prompts": [P]},
    ]})
    after = reel["phases"][2][0]
    assert after["token_ids"] == cold["phases"][0][0]["token_ids"]
    assert after["logprobs"] == cold["phases"][0][0]["logprobs"]
    m = reel["metrics"]
    assert m["vllm:kvreel_corrupt_chunks_total|disk"] == 3
    assert m["vllm:kvreel_load_error_blocks_total"] == 18
    assert reel["log"].count("payload checksum mismatch") == 3     # logged once per chunk
    assert reel["phases"][3][0]["num_cached_tokens"] == 576
    assert m["vllm:kvreel_lookup_hit_blocks_total|host"] >= 18


def test_truncated_and_foreign_files_are_misses(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    cfg = {"cpu_bytes": "64MiB", "disk_dir": str(disk)}
    reel = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [{"prompts": [P]}]})
    # P's chunks: blocks 0-7, 8-15 (the two largest files, in an order their names do not tell) and 16-17
    files = sorted(glob.glob(f"{disk}/*/rank0/*/*.kvr"), key=os.path.getsize, reverse=True)
    assert len(files) == 3
    # truncate one of the first two chunks, move the other under a foreign model identity
    with open(files[0], "r+b") as f:
        f.truncate(1000)
    data = open(files[1], "rb").read().replace(files[1].split("/")[-4].encode(), b"f" * 20, 1)
    open(files[1], "wb").write(data)
    again = run_scenario({"model": tiny_model, "kvreel": cfg, "phases": [{"prompts": [P]}]})
    assert "ignoring unusable chunk file" in again["log"]
    assert again["metrics"]["vllm:kvreel_corrupt_chunks_total|disk"] == 2
    # blocks of the first chunk are gone, so nothing of P can be reused
    assert again["phases"][0][0]["num_cached_tokens"] == 0
    assert again["phases"][0][0]["logprobs"] == reel["phases"][0][0]["logprobs"]


def test_a_disk_that_fills_turns_the_tier_off_and_back_on_when_freed(tiny_model, tmp_path):
    """A tmpfs filled by another file: the chunk write fails (ENOSPC), the disk
    tier goes off and serving continues from host memory; once the file is
    removed the tier's probe turns it back on and new chunks land on disk."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mount.returncode != 0:
        if os.geteuid() == 0:        # root can mount: a failure here is a broken test machine, not a reason to skip
            pytest.fail(f"mounting a small tmpfs failed as root: {mount.stderr.strip()}")
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    q, r = tokens(600, 2), tokens(600, 3)
    try:
        base = run_scenario({"model": tiny_model, "phases": [{"prompts": [p]} for p in (P, P, q, r, r)]})
        reel = run_scenario({"model": tiny_model, "kvreel": {"cpu_bytes": "64MiB", "disk_dir": str(mnt)}, "phases": [
            {"before": f"shell:dd if=/dev/zero of={mnt}/filler bs=64k 2>/dev/null || true", "prompts": [P]},
            {"before": "reset_prefix_cache", "prompts": [P]},
            {"before": f"shell:rm {mnt}/filler && sleep 10", "prompts": [q]},   # the probe backs off to 8 s at most
            {"prompts": [r]},
            {"before": "reset_prefix_cache", "prompts": [r]}]})
        files = list(scan_chunk_files(mnt, next(d.name for d in mnt.iterdir() if d.is_dir())))
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
    assert "disk tier disabled" in reel["log"] and "disk tier back on" in reel["log"]
    assert reel["metrics"]["vllm:kvreel_disk_write_failures_total"] >= 1
    assert files and not any(isinstance(header, ChunkError) for *_, header in files)
    # vLLM with any KV connector attached (its own ExampleConnector too) decodes some
    # fresh prompts (q, r) in different low bits than without one; P is not among them
    for phase, (got, want) in enumerate(zip(reel["phases"], base["phases"])):
        assert got[0]["token_ids"] == want[0]["token_ids"], phase
    assert [ph[0]["logprobs"] for ph in reel["phases"][:2]] == [ph[0]["logprobs"] for ph in base["phases"][:2]]
    assert reel["phases"][1][0]["num_cached_tokens"] > 0 and reel["phases"][4][0]["num_cached_tokens"] > 0


def test_unwritable_disk_dir_disables_the_tier(tiny_model, tmp_path):
    # A path that parses (so startup goes on) but cannot be created: its parent is a file.
    # (A path naming a file itself is refused at load: tests/test_config.py.)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    not_a_dir = blocker / "kv"
    base = run_scenario({"model": tiny_model, "phases": [{"prompts": [P]}, {"prompts": [P]}]})
    reel = run_scenario({"model": tiny_model, "kvreel": {"cpu_bytes": "64MiB", "disk_dir": str(not_a_dir)},
                         "phases": [{"prompts": [P]}, {"before": "reset_prefix_cache", "prompts": [P]}]})
    assert "is not writable" in reel["log"]
    assert reel["phases"][1][0] == base["phases"][1][0]


def test_invalid_setting_stops_startup_with_its_name(tiny_model):
    with pytest.raises(AssertionError) as err:
        run_scenario({"model": tiny_model, "kvreel": {"cpu_bytes": "lots"}, "phases": []})
    assert "kv_connector_extra_config['cpu_bytes']='lots' is invalid" in str(err.value)
