"""Soak and faults against vLLM's OpenAI server with kvreel (loopback only).

    python bench/soak.py --model ../shared/models/tinycode-16m-4k --minutes 10

Concurrent clients stream completions for a pool of prompts, most of them
sharing one of a few long prefixes, the rest unique. kvreel runs with a small
host tier (evictions all the time), a disk tier on a small tmpfs (when run as
root) and Redis as the remote tier; vLLM's own prefix cache is reset every
``--reset-every`` seconds so reuse goes through kvreel. A few long sessions
(``--long-prompts``) start at 3 000 tokens and grow by ``--grow`` tokens a turn
(a stream of new text) up to ``--long-max`` tokens, well past vLLM's paged
cache (``--kv-blocks``): above ``KVREEL_RETRIEVAL_MIN_TOKENS`` = 2 400 their
history lives in kvreel (ReSV through the DRE service) and every turn comes
back as a cached prefix. During the run:
Redis is killed and restarted empty, the disk tier is filled and freed, the DRE
is killed (twice), and stored chunks (disk files and Redis values) are
corrupted. Every distinct answer to a prompt under the retrieval threshold is
checked token by token against plain vLLM after the run (idle, same model):
teacher-forced, each answer token's logprob is compared with the greedy
choice's. vLLM's CPU kernels round differently with the batch a request shares,
so under load even plain vLLM picks, at near ties, a token a hair below the
idle greedy one (``--control`` measures how far for plain vLLM alone); a token
more than ``--tolerance`` nats below is wrong. To show the check can fail,
answers are also checked against a prompt they do not belong to.
Long sessions attend to part of their history by design: their answers
(``--long-checks`` of them) are teacher-forced through full attention and how
many tokens stray is reported, not counted as wrong. Reported: requests,
errors, wrong answers and tokens, TTFT p50/p99 per phase, retrieval counters,
the memory of every server process over time and its spread after
``--warmup-minutes``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from kvreel.cli.serve import CONNECTOR_JSON
from kvreel.cli.server_process import stop_server

sys.path.insert(0, str(Path(__file__).parent))
from common import (free_port, load_results, machine_words, python_source_corpus, rss_by_process_mib,  # noqa: E402
                    save, save_figure, scratch, start_openai_server, start_redis)

MEASURES = ("connector", "scheduler", "codec")  # the package paths its figures measure (bench/report.py)



def start_server(model: str, env: dict, kvreel: bool, log: Path, kv_blocks: int = 0,
                 max_model_len: int = 4096) -> tuple[subprocess.Popen, str]:
    args = ["--block-size", "32", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--gpu-memory-utilization", "0.05", "--served-model-name", "m", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--enable-prompt-tokens-details"]
    if kv_blocks:       # a small paged cache: vLLM evicts prefixes, so reuse has to come from kvreel
        args += ["--num-gpu-blocks-override", str(kv_blocks)]
    if kvreel:
        args += ["--kv-transfer-config", CONNECTOR_JSON]
    return start_openai_server(model, args, {"VLLM_SERVER_DEV_MODE": "1", **env}, log)


def complete(base: str, ids: list[int], max_tokens: int, timeout: float = 120):
    """(tokens, ttft seconds, total seconds, prompt tokens served from cache, the
    server's id of the request) of one streamed greedy completion."""
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens, cached, rid = None, [], None, None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = rid or chunk.get("id")
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if not chunk.get("choices"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens += (chunk["choices"][0].get("logprobs") or {}).get("tokens") or []
    if cached is None:
        raise RuntimeError("the server sent no usage (needs --enable-prompt-tokens-details)")
    return tokens, ttft if ttft is not None else time.perf_counter() - t0, time.perf_counter() - t0, cached, rid


def reset_prefix_cache(base: str) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(base + "/reset_prefix_cache", data=b"{}", method="POST"),
                               timeout=30).read()
        return True
    except OSError:
        return False


def greedy_gaps(base: str, prompt: list[int], answer: list[int], model: str = "m") -> list[float]:
    """Teacher-forced check of one answer on plain vLLM: for each answer token, how
    far (nats) its logprob lies below the most likely token's, given the prompt and
    the answer's own tokens before it. 0 where the answer took the greedy choice.
    Requests with prompt logprobs skip vLLM's prefix cache, so the whole sequence is
    computed in one idle pass."""
    body = json.dumps({"model": model, "prompt": prompt + answer, "max_tokens": 1, "temperature": 0,
                       "prompt_logprobs": 1}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        entries = json.loads(resp.read())["choices"][0]["prompt_logprobs"][len(prompt):]
    gaps = []
    for token, entry in zip(answer, entries):
        best = max(e["logprob"] for e in entry.values())
        gaps.append(best - entry[str(token)]["logprob"])
    return gaps


def answer_ids(answer: list[str]) -> list[int]:
    """Token ids of a streamed answer (``return_tokens_as_token_ids``: "token_id:N")."""
    return [int(t.split(":", 1)[1]) for t in answer]


def soak_prompt(corpus: list[int], i: int, prefixes: int = 6, prefix_tokens: int = 1536) -> list[int]:
    """Prompt ``i`` of the pool: one of ``prefixes`` long shared prefixes plus a
    64-token suffix of its own; every fourth prompt shares nothing."""
    tail = corpus[prefixes * prefix_tokens:]
    if i % 4 == 3:
        return tail[200_000 + i * 700:200_000 + i * 700 + 700]
    return corpus[(i % prefixes) * prefix_tokens:(i % prefixes + 1) * prefix_tokens] + tail[i * 97:i * 97 + 64]


class LongSession:
    """A session that grows every turn: one of the shared prefixes, history of its
    own, then ``grow`` new tokens a turn (a stream of text) until ``longest``."""

    def __init__(self, corpus: list[int], j: int, start: int, grow: int, longest: int):
        own = corpus[400_000 + j * 20_000:400_000 + (j + 1) * 20_000]
        self.tokens = corpus[(j % 6) * 1536:(j % 6 + 1) * 1536] + own[:start - 1536]
        self.stream, self.grow, self.longest = own[start - 1536:], grow, longest
        self.lock = threading.Lock()

    def next_prompt(self) -> list[int]:
        if len(self.tokens) + self.grow <= self.longest and self.stream:
            self.tokens, self.stream = self.tokens + self.stream[:self.grow], self.stream[self.grow:]
        return list(self.tokens)


def kill_program(program: str) -> int:
    """SIGKILL every process run as ``python -m program``; how many."""
    import signal
    killed = 0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and program.encode() in (proc / "cmdline").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
        except OSError:
            continue
    return killed


def memory_after_warmup(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    """Each process's RSS over the samples after ``warmup_s``: first, last, min, max
    and spread ((max - min) / min), the soak's flatness figure."""
    later = [s for s in samples if s["t"] >= warmup_s] or samples[-1:]
    out = {}
    for name in sorted({n for s in later for n in s["processes"]}):
        xs = [s["processes"][name] for s in later if name in s["processes"]]
        out[name] = {"first": xs[0], "last": xs[-1], "min": min(xs), "max": max(xs),
                     "spread": (max(xs) - min(xs)) / min(xs)}
    return out


def corrupt(disk_dir: Path, redis_port: int, rng: random.Random) -> int:
    """Flip a byte in a third of the stored chunks (disk files and Redis values); how many."""
    import redis
    n = 0
    for path in list(disk_dir.rglob("*.kvr"))[::3]:
        try:
            data = bytearray(path.read_bytes())
            data[rng.randrange(64, len(data))] ^= 0xFF
            path.write_bytes(bytes(data))
            n += 1
        except (OSError, ValueError):
            pass
    try:
        r = redis.Redis(port=redis_port)
        for i, key in enumerate(r.scan_iter("kvreel/*/c/*")):
            if i % 3 == 0:
                size = r.strlen(key)
                pos = rng.randrange(64, size)
                r.setrange(key, pos, bytes([r.getrange(key, pos, pos)[0] ^ 0xFF]))
                n += 1
    except redis.RedisError:
        pass
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--reset-every", type=float, default=20)
    ap.add_argument("--host-bytes", default="8MiB", help="kvreel host tier: small, so disk and Redis serve too")
    ap.add_argument("--kv-blocks", type=int, default=160,
                    help="vLLM's paged cache in blocks during the soak (reset_prefix_cache fails under load, "
                         "so eviction is what sends reuse through kvreel); long sessions outgrow it")
    ap.add_argument("--long-prompts", type=int, default=4, help="long sessions served with retrieval attention")
    ap.add_argument("--grow", type=int, default=400, help="tokens a long session gains per turn")
    ap.add_argument("--long-max", type=int, default=7680, help="a long session stops growing here")
    ap.add_argument("--budget", type=int, default=1024, help="KVREEL_RETRIEVAL_BUDGET_TOKENS")
    ap.add_argument("--no-faults", action="store_true", help="load only")
    ap.add_argument("--long-checks", type=int, default=150,
                    help="long-session answers teacher-forced through full attention after the run (at most)")
    ap.add_argument("--warmup-minutes", type=float, default=5,
                    help="memory is judged flat or not on the samples after this")
    ap.add_argument("--tolerance", type=float, default=0.25,
                    help="nats below plain vLLM's greedy choice that still count as rounding, not a wrong token")
    ap.add_argument("--name", help="results name (default: soak, or soak_control)")
    ap.add_argument("--control", action="store_true",
                    help="the same load on plain vLLM (no kvreel, no faults): the mismatch rate numerics alone give")
    ap.add_argument("--replot", metavar="NAME", help="only redraw results/NAME.png from results/NAME.json")
    a = ap.parse_args()
    if not (a.model or a.replot):
        ap.error("--model is required (or --replot NAME)")
    if a.replot:
        _plot(load_results(a.replot), a.replot)
        return
    with scratch("kvreel-soak-") as work:
        run(a, work)


def run(a: argparse.Namespace, work: Path) -> None:
    """The soak in working folder ``work``: load and faults, then the checks."""
    from transformers import AutoTokenizer
    rng = random.Random(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    corpus = tok(python_source_corpus(2_000_000))["input_ids"]
    prompts = [soak_prompt(corpus, i, a.prefixes, a.prefix_tokens) for i in range(a.prompts)]
    exact = len(prompts)                  # picks from here on are long sessions (retrieval)
    sessions = [LongSession(corpus, j, 3000, a.grow, a.long_max) for j in range(0 if a.control else a.long_prompts)]

    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}

    disk = work / "disk"
    disk.mkdir()
    tmpfs = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)],
                                                 capture_output=True).returncode == 0
    redis_port = free_port()
    redis_dir = str(work / "redis")
    redis, _ = start_redis(redis_dir, redis_port)
    kenv = {**env, "KVREEL_CPU_BYTES": a.host_bytes, "KVREEL_DISK_DIR": str(disk), "KVREEL_DISK_BYTES": "40MiB",
            "KVREEL_REMOTE_URL": f"redis://127.0.0.1:{redis_port}/0", "KVREEL_REMOTE_TIMEOUT_S": "1",
            "KVREEL_RETRIEVAL": "resv", "KVREEL_RETRIEVAL_MIN_TOKENS": "2400", "KVREEL_RETRIEVAL_ALPHA": "0.9",
            "KVREEL_RETRIEVAL_WINDOW": "256", "KVREEL_RETRIEVAL_BUDGET_TOKENS": str(a.budget)}
    if a.control:
        kenv = env
    if a.control:       # plain vLLM with a cache that holds the load (no long sessions)
        server, base = start_server(a.model, kenv, False, work / "kvreel.log")
    else:
        server, base = start_server(a.model, kenv, True, work / "kvreel.log", a.kv_blocks,
                                    max_model_len=a.long_max + 64)
    duration = a.minutes * 60
    # chunks are corrupted once while the disk tier serves (a full disk disables it) and twice after
    faults = [] if a.control or a.no_faults else [
        (0.20, "redis killed"), (0.35, "redis restarted (empty)"), (0.42, "chunks corrupted"), (0.50, "disk filled"),
        (0.55, "DRE killed"), (0.65, "disk freed"), (0.75, "chunks corrupted"), (0.85, "chunks corrupted"),
        (0.90, "DRE killed")]
    events, samples, results = [], [], []
    lock = threading.Lock()
    t_start = time.monotonic()
    stop_at = t_start + duration

    def client(seed):
        r = random.Random(seed)
        while time.monotonic() < stop_at:
            i = r.randrange(len(prompts) + len(sessions))
            session = sessions[i - exact] if i >= exact else None
            if session is not None and not session.lock.acquire(blocking=False):
                continue                    # a session's turns come one after the other
            t = time.monotonic() - t_start
            try:
                ids = session.next_prompt() if session is not None else prompts[i]
                answer, ttft, total, cached, rid = complete(base, ids, a.max_tokens)
                rec = {"t": t, "prompt": i, "ttft": ttft, "total": total, "ok": True, "long": i >= exact,
                       "tokens": len(ids), "cached": cached, "answer": answer, "id": rid}
            except Exception as e:  # noqa: BLE001 — an error is a result here
                rec = {"t": t, "prompt": i, "ok": False, "error": str(e)[:200]}
            finally:
                if session is not None:
                    session.lock.release()
            with lock:
                results.append(rec)

    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in range(a.clients)]
    for th in threads:
        th.start()
    next_reset = a.reset_every
    bar = tqdm(total=int(duration), desc="soak", unit="s")
    filler = disk / "filler.bin"
    while time.monotonic() < stop_at:
        now = time.monotonic() - t_start
        while faults and now >= faults[0][0] * duration:
            _, what = faults.pop(0)
            n = ""
            if what == "redis killed":
                redis.kill()
                redis.wait()
            elif what.startswith("redis restarted"):
                redis, _ = start_redis(redis_dir, redis_port)
            elif what == "disk filled":
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * (1 << 20))
                            f.flush()
                    except OSError:
                        pass
            elif what == "DRE killed":
                n = f" ({kill_program('kvreel.dre.service')} process)"
            elif what == "disk freed":
                filler.unlink(missing_ok=True)
            else:
                n = f" ({corrupt(disk, redis_port, rng)} chunks)"
            events.append({"t": now, "event": what + n})
            tqdm.write(f"{now:6.0f}s  {what}{n}")
        if now >= next_reset:
            reset_prefix_cache(base)
            next_reset += a.reset_every
        processes = rss_by_process_mib(server.pid)
        samples.append({"t": now, "rss_mib": sum(processes.values()), "processes": processes})
        bar.update(int(now) - bar.n)
        time.sleep(5)
    for th in threads:
        th.join(timeout=180)
    bar.close()
    metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    kvreel_metrics = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in metrics.splitlines()
                      if line.startswith("vllm:kvreel_") and "_created" not in line}
    ok = [r for r in results if r["ok"]]
    # The oracle: each distinct answer to a prompt under the threshold, teacher-forced
    # through plain vLLM on an idle server. A token is wrong when plain vLLM ranks it
    # more than --tolerance nats below its greedy choice at that position; rounding
    # from the batch a request shared moves logits by far less (--control measures it
    # for plain vLLM under the same load), a wrong block by far more.
    ref_server, ref_base = start_server(a.model, env, False, work / "reference.log", max_model_len=a.long_max + 64)
    distinct = {(r["prompt"], tuple(r["answer"])) for r in ok if not r["long"]}
    gaps = {key: greedy_gaps(ref_base, prompts[key[0]], answer_ids(list(key[1])))
            for key in tqdm(sorted(distinct), desc="teacher-forced check")}
    # the same check on answers put after a prompt they do not belong to: it must fire
    shuffled = sorted(distinct)[:: max(1, len(distinct) // 12)]
    foreign_gaps = [x for i, ans in shuffled
                    for x in greedy_gaps(ref_base, prompts[(i + 1) % exact], answer_ids(list(ans)))]
    foreign = {"answers": len(shuffled), "tokens": len(foreign_gaps),
               "flagged_tokens": sum(x > a.tolerance for x in foreign_gaps)}
    # long sessions' answers, teacher-forced through full attention: retrieval reads part of
    # the history by design, so how far they stray is reported, not counted as wrong
    longs = [r for r in ok if r["long"]]
    longs = longs[::max(1, -(-len(longs) // a.long_checks))]
    long_gaps = [x for r in tqdm(longs, desc="long sessions vs full attention")
                 for x in greedy_gaps(ref_base, sessions[r["prompt"] - exact].tokens[:r["tokens"]],
                                      answer_ids(r["answer"]))]
    long_check = {"answers": len(longs), "tokens": len(long_gaps), "off_greedy_tokens": sum(x > 0 for x in long_gaps),
                  "over_tolerance_tokens": sum(x > a.tolerance for x in long_gaps),
                  "max_gap_nats": max(long_gaps, default=0.0),
                  "reference": "plain vLLM, full attention, idle; answers taken evenly over the run"}
    stop_server(ref_server)
    stop_server(server)
    redis.kill()
    if tmpfs:
        subprocess.run(["umount", str(disk)])

    for r in ok:
        g = [] if r["long"] else gaps[(r["prompt"], tuple(r["answer"]))]
        r["gaps"] = g
        r["max_gap"] = max(g, default=0.0)
        r["off_greedy_tokens"] = sum(x > 0 for x in g)
        r["wrong_tokens"] = sum(x > a.tolerance for x in g)
        r["wrong"] = r["wrong_tokens"] > 0
    ttfts = sorted(r["ttft"] for r in ok)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    phases = {}
    marks = [0.0] + [e["t"] for e in events] + [duration]
    labels = ["start"] + [e["event"] for e in events]
    for lo, hi, label in zip(marks, marks[1:], labels):
        xs = sorted(r["ttft"] for r in ok if lo <= r["t"] < hi)
        phases[f"{lo:.0f}-{hi:.0f}s after {label}"] = {"requests": len(xs), "ttft_p50_s": pct(xs, 0.5),
                                                        "ttft_p99_s": pct(xs, 0.99)}
    out = {"model": a.model, "minutes": a.minutes, "clients": a.clients, "prompts": a.prompts,
           "disk_tier_on_tmpfs": tmpfs, "requests": len(results), "served": len(ok),
           "errors": len(results) - len(ok),
           "oracle": "each distinct answer under the threshold teacher-forced through plain vLLM (idle, no "
                     "prefix cache); a token is wrong when its logprob is more than tolerance_nats below the "
                     "greedy choice's",
           "tolerance_nats": a.tolerance, "checked_answers": sum(not r["long"] for r in ok),
           "distinct_answers_checked": len(distinct),
           "answer_tokens_checked": sum(len(r["answer"]) for r in ok if not r["long"]),
           "off_greedy_tokens": sum(r["off_greedy_tokens"] for r in ok),
           "max_gap_nats": max((r["max_gap"] for r in ok), default=0.0),
           "off_greedy_gaps_nats_distinct_answers": sorted(x for g in gaps.values() for x in g if x > 0),
           "foreign_check": foreign,
           "wrong_answers": sum(r["wrong"] for r in ok), "wrong_tokens": sum(r["wrong_tokens"] for r in ok),
           "long_session_requests": sum(1 for r in results if r["prompt"] >= exact),
           "long_session_served": sum(1 for r in ok if r["long"]),
           "long_session_tokens_max": max((r["tokens"] for r in ok if r["long"]), default=0),
           "long_session_check": long_check,
           "paged_cache_tokens": a.kv_blocks * 32,
           "wrong_examples": [{k: r[k] for k in ("t", "id", "prompt", "tokens", "cached", "ttft", "answer", "gaps")}
                              for r in ok if r["wrong"]][:20],
           "wrong_by_prompt": {i: n for i in range(exact)
                               if (n := sum(1 for r in ok if r["prompt"] == i and r["wrong"]))},
           "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
           "rss_mib": {"first": samples[0]["rss_mib"], "last": samples[-1]["rss_mib"],
                       "max": max(s["rss_mib"] for s in samples)},
           "warmup_s": a.warmup_minutes * 60,
           "rss_after_warmup_mib": memory_after_warmup(samples, a.warmup_minutes * 60),
           "events": events, "phases": phases, "kvreel_metrics": kvreel_metrics,
           "error_examples": [r["error"] for r in results if not r["ok"]][:5],
           "retrieval_metrics": {k: v for k, v in kvreel_metrics.items() if "retrieval" in k or "dre" in k},
           "memory": samples,
           "timeline": [{"t": round(r["t"], 2), "ttft_s": round(r["ttft"], 4) if r["ok"] else None,
                         "wrong": bool(r.get("wrong"))} for r in results]}
    out["control"] = a.control
    name = a.name or ("soak_control" if a.control else "soak")
    path = save(name, out)
    _plot(out, name)
    long_fields = ("memory", "phases", "kvreel_metrics", "off_greedy_gaps_nats_distinct_answers")
    print(json.dumps({k: v for k, v in out.items() if k not in long_fields}, indent=1))
    print("wrote", path)
    keep = Path(__file__).parent / "data"
    keep.mkdir(exist_ok=True)
    shutil.copy(work / "kvreel.log", keep / f"{name}_server.log")


def _plot(out: dict, name: str) -> None:
    """TTFT of every request (errors as crosses, wrong answers red; from a JSON
    without the timeline, each phase's p50 and p99) and each server process's
    memory over the run, the faults marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # a JSON from before per-process sampling holds only the sum
    samples = [m if "processes" in m else {**m, "processes": {"server processes (sum)": m["rss_mib"]}}
               for m in out["memory"]]
    events = out["events"]
    fig, ax = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if "timeline" in out:
        ok = [r for r in out["timeline"] if r["ttft_s"] is not None]
        ax[0].scatter([r["t"] for r in ok], [r["ttft_s"] * 1000 for r in ok], s=3,
                      c=["red" if r["wrong"] else "tab:blue" for r in ok])
        bad = [r for r in out["timeline"] if r["ttft_s"] is None]
        ax[0].scatter([r["t"] for r in bad], [1] * len(bad), s=12, marker="x", color="black", label="errors")
        ax[0].set_ylabel("TTFT (ms)")
    else:
        for key, style in (("ttft_p50_s", "-"), ("ttft_p99_s", "--")):
            for label, phase in out["phases"].items():
                start, end = (float(x) for x in label.split("s ")[0].split("-"))
                ax[0].hlines(phase[key] * 1000, start, end, color="tab:blue", ls=style)
            ax[0].plot([], [], color="tab:blue", ls=style, label=key[5:8] + " of the phase")
        ax[0].legend(fontsize=7, loc="lower right")
        ax[0].set_ylabel("TTFT per phase (ms)")
    ax[0].set_yscale("log")
    for process in sorted({n for s in samples for n in s["processes"]}):
        ax[1].plot([s["t"] for s in samples if process in s["processes"]],
                   [s["processes"][process] for s in samples if process in s["processes"]], label=process)
    if "warmup_s" in out:
        ax[1].axvline(out["warmup_s"], color="black", lw=0.7, label="end of warm-up")
    ax[1].set_ylabel("RSS (MiB)")
    ax[1].legend(fontsize=7)
    ax[1].set_xlabel("seconds")
    for e in events:
        for axis in ax:
            axis.axvline(e["t"], color="grey", lw=0.7, ls="--")
        ax[0].text(e["t"], ax[0].get_ylim()[1], e["event"], rotation=90, fontsize=6, va="top")
    host = out["machine"]
    title = (f"{Path(out['model']).name}: vllm-cpu {host['vllm'].split()[0]}'s OpenAI server "
             f"{'alone' if out['control'] else 'with kvreel'}, {out['clients']} clients, {out['minutes']:g} min, "
             f"faults marked; {machine_words(host)}; commit {out['commit'][:7]}; one run")
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
