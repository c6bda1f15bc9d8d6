"""kvreel settings: ``KVREEL_*`` environment variables, overridable per engine
through ``kv_connector_extra_config``.

Every setting is validated at startup; a bad value raises ``ConfigError`` naming
the variable and what it accepts, and an unknown ``KVREEL_*`` name (a typo)
raises with the closest valid name, because a silently ignored setting is worse
than a refused start.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
from dataclasses import dataclass, make_dataclass
from typing import Any, Callable, Mapping, get_type_hints

from kvreel.codec.formats import FORM_KINDS, RAW, VIDEO_FORM, ZSTD, form_kind, form_resolution
from kvreel.codec.layout import NVDEC_MIN_SIDE
from kvreel.codec.quant import QUANTS

PREFIX = "KVREEL_"


class ConfigError(ValueError):
    """A kvreel setting is missing, malformed or out of range."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; SI (KB, MB, GB, TB) and IEC (KiB…TiB) units."""
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class Setting:
    name: str          # without the prefix, e.g. "CPU_BYTES"
    parse: Callable[[str], Any]
    default: Any
    accepts: str       # human description of the accepted values
    doc: str
    check: Callable[[Any], bool] = lambda v: True


def _bytes_setting(name, default, doc, minimum=0):
    return Setting(name, parse_bytes, default,
                   f"a size >= {format_bytes(minimum)} such as 512MiB, 8GiB or 1000000", doc,
                   lambda v: v >= minimum)


def _int_setting(name, default, doc, lo, hi):
    return Setting(name, int, default, f"an integer in [{lo}, {hi}]", doc, lambda v: lo <= v <= hi)


def _directory(text: str) -> str | None:
    """A directory path that may not exist yet (the tier creates it), not a file."""
    if not text:
        return None
    if "\0" in text or os.path.isfile(text):
        raise ValueError(text)
    return text


def _dre_address(text: str) -> str | None:
    """A Unix-socket path (it has a ``/``) or ``host:port`` (``kvreel.dre.wire.listen``/``connect`` read either)."""
    if not text:
        return None
    if "/" in text:
        if "\0" in text or os.path.isdir(text):
            raise ValueError(text)
        return text
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536 or " " in host:
        raise ValueError(text)
    return text


def _remote_url(text: str) -> str | None:
    if not text:
        return None
    if not text.startswith(("redis://", "rediss://", "redis-cluster://", "file://")):
        raise ValueError(text)
    if text.startswith("redis-cluster://"):
        from kvreel.connector.tiers.store import parse_cluster_url
        parse_cluster_url(text)
    return text


def _hex_secret(text: str) -> str | None:
    from kvreel.dre.wire import parse_secret_hex         # the DRE service checks it the same way
    return text if parse_secret_hex(text) else None


def _forms(text: str) -> tuple[str, ...]:
    forms = tuple(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    if RAW not in forms or any(f not in FORM_KINDS for f in forms):
        raise ValueError(text)
    return forms


def _resolutions(text: str) -> tuple[int, ...]:
    out = tuple(sorted({int(r) for r in text.split(",") if r.strip()}))
    if not out or any(not NVDEC_MIN_SIDE <= r <= 4096 for r in out):
        raise ValueError(text)
    return out


def _fetch_form(text: str) -> str:
    if text != "auto" and text not in (RAW, ZSTD) and not re.fullmatch(rf"{VIDEO_FORM}@\d+", text):
        raise ValueError(text)
    return text


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: v in choices


SETTINGS: tuple[Setting, ...] = (
    _bytes_setting("CPU_BYTES", 4 * 1024**3,
                   "Host-memory tier size per worker (pinned on CUDA). 0 disables the host tier."),
    Setting("DISK_DIR", _directory, None, "a writable directory path (unset: no disk tier)",
            "Disk tier directory; chunks persist there across engine restarts."),
    _bytes_setting("DISK_BYTES", 64 * 1024**3, "Disk tier capacity; least recently used chunks are deleted beyond it.",
                   minimum=1024**2),
    _int_setting("CHUNK_TOKENS", 256, "Offload granularity in tokens: a stored chunk holds at most this many "
                 "tokens (a multiple of the engine's block size).", 16, 1 << 20),
    _int_setting("DISK_WRITE_QUEUE", 64, "Chunks waiting for the background disk writer before new writes "
                 "are dropped (never blocking the forward pass).", 1, 1 << 16),
    Setting("SAVE_COPY", str, "thread", "thread or step",
            "Where a CPU engine copies the blocks a step computed out of vLLM's cache: thread (on a thread "
            "beside the model's cores while the next step runs; that step waits for it only before writing a "
            "block it still reads) or step (inside the step, on the model's cores). CUDA engines copy on a "
            "side stream either way.", _one_of("thread", "step")),
    Setting("REMOTE_URL", _remote_url, None, "redis://[:password@]host:port/db, "
            "redis-cluster://[:password@]host:port[,host:port...] (any nodes of a Redis Cluster) or file:///path "
            "(unset: no remote tier)", "Shared remote tier; every engine of the same model reuses what any of them stored."),
    Setting("REMOTE_TIMEOUT_S", float, 2.0, "a number of seconds in (0, 60]",
            "Connect/read timeout of remote-store calls; a dead store costs at most this, then recompute.",
            lambda v: 0 < v <= 60),
    _int_setting("REMOTE_LOOKUP_WAIT_MS", 5, "Most milliseconds one scheduler step waits for remote-store "
                 "lookups (all its new requests together) before it goes on without them (they are asked again "
                 "next step). A store that answers within this costs a new request no step; a slow or dead "
                 "one is not waited for until it answers in time again. 0: never wait.", 0, 1000),
    _int_setting("REMOTE_WRITE_QUEUE", 64, "Chunks waiting for the background remote uploader before new "
                 "uploads are dropped (never blocking the forward pass).", 1, 1 << 16),
    Setting("REMOTE_FORMS", _forms, (RAW, ZSTD), f"a comma list of {', '.join(FORM_KINDS)} that includes raw",
            "Forms each remote chunk is stored in; a fetch picks one per chunk. raw is the exact fallback; "
            "video (lossless HEVC, decoded on NVDEC) pays off where the link is slower than the decoders; "
            "its encode costs CPU time in the uploader unless NVENC is present."),
    Setting("REMOTE_QUANT", str, "none", " or ".join(QUANTS),
            "Quantizer of the video form: none is exact, int8 is smaller and lossy (per-channel min-max).",
            _one_of(*QUANTS)),
    Setting("REMOTE_RESOLUTIONS", _resolutions, (256, 512), f"a comma list of frame sides in [{NVDEC_MIN_SIDE}, 4096]",
            "Resolutions the video form is stored at (one bitstream each); the fetcher picks per chunk."),
    Setting("FETCH_FORM", _fetch_form, "auto", "auto, raw, zstd or video@<resolution>",
            "auto: per chunk, the stored form with the least transfer/decode time at the measured bandwidth "
            "and decoder load (KVFetcher Alg. 1 plus format choice); otherwise always this form."),
    Setting("FETCH_POLICY", str, "fair", "fair or fcfs",
            "How concurrent remote fetches share the link: fair (the request with the fewest chunks in flight "
            "goes next; a lone fetch gets every stream) or fcfs (oldest request first).",
            _one_of("fair", "fcfs")),
    Setting("FETCH_MODE", str, "async", "async or blocking",
            "async: a request whose prefix is on disk or remote waits in WAITING_FOR_REMOTE_KVS while others "
            "run; blocking loads inside the forward pass and stalls the batch (a baseline for benchmarks).",
            _one_of("async", "blocking")),
    _int_setting("FETCH_STREAMS", 4, "Chunk transfers in flight at once; as many decoders (NVDEC sessions or "
                 "CPU decode threads) decode behind them.", 1, 64),
    Setting("EVICTION", str, "workflow", "lru or workflow",
            "Which chunks the host and disk tiers evict first. workflow: requests that carry agent-workflow "
            "hints (kv_transfer_params, see kvreel.scheduler.workflow) rank their chunks by steps until their "
            "agent runs next and the furthest go first, LRU among equals and for everything unhinted (without "
            "hints it is LRU); lru: hints are ignored.", _one_of("lru", "workflow")),
    _int_setting("PREFETCH_DEPTH", 2, "With KVREEL_EVICTION=workflow, the chunks of an agent at most this many "
                 "steps from running are read from disk into the host tier in the background. 0: no prefetch.",
                 0, 64),
    _bytes_setting("PREFETCH_BYTES", 256 * 1024**2, "Most bytes of prefetches in flight at once (they never "
                   "wait in front of a request's load)."),
    Setting("RETRIEVAL", str, "off", "off, resv or mosaic",
            "Sessions longer than vLLM's KV memory: a long request's history moves to kvreel's host memory and "
            "each layer attends to the sink, the history tokens its step's own queries select and the local "
            "window. off (vLLM untouched), resv (hash-bit key clusters, V-Rex) or mosaic (visual -> semantic "
            "clusters): the DRE's clusters narrow long histories. Needs kvreel's connector; registered by "
            "kvreel's vLLM plugin (vLLM's CPU backend).",
            _one_of("off", "resv", "mosaic")),
    Setting("RETRIEVAL_ALPHA", float, 0.9, "a number in (0, 1]",
            "WiCSum ratio: per KV head, history tokens are kept in the order the step's queries score them until "
            "every query row holds this share of its attention mass, or the budget is reached.",
            lambda v: 0 < v <= 1),
    _int_setting("RETRIEVAL_MIN_TOKENS", 2048, "Requests with fewer computed tokens keep all their KV in vLLM "
                 "and attend fully; so does every position below this, for every request.", 0, 1 << 30),
    _int_setting("RETRIEVAL_WINDOW", 512, "Local window: a long request's newest tokens (beyond the step's own), "
                 "kept in vLLM's cache and always attended to, as is the first block (attention sinks).",
                 0, 1 << 30),
    Setting("RETRIEVAL_BUDGET_SHARE", float, 0.125, "a number in (0, 1]",
            "Working set per long request and layer: at most this share of the history (sink block included) is "
            "attended to in one step, chosen anew for every step's queries; 1 with a token budget that holds "
            "the history keeps all of it (outputs identical to vLLM's).", lambda v: 0 < v <= 1),
    _int_setting("RETRIEVAL_CANDIDATES", 8, "How many times the budget's tokens a prefill chunk's step scores "
                 "exactly with its queries. A history at least twice that long is narrowed first by its DRE "
                 "clusters (ranked by centroid and by their keys' bounds), so a step's cost grows slower than "
                 "the history; 0: never narrowed (a chunk then attends to the whole history, or with "
                 "KVREEL_RETRIEVAL_PREFILL_SELECT=always scores every history token).", 0, 1024),
    _int_setting("RETRIEVAL_DECODE_CANDIDATES", 2, "Decoding steps (and chunks of at most "
                 "KVREEL_RETRIEVAL_ROWS_PER_SET tokens) attend to whole history blocks, copied as vLLM packed "
                 "them: the blocks holding most of their queries' attention, scored exactly among this many times "
                 "the budget's tokens of blocks that their queries rank best by their keys' channel-wise bounds "
                 "(Quest: a cost that grows with the blocks, not the tokens), from a history twice that long on. "
                 "0: they choose tokens as prefill chunks do (KVREEL_RETRIEVAL_CANDIDATES, "
                 "KVREEL_RETRIEVAL_NARROWING).", 0, 1024),
    Setting("RETRIEVAL_NARROWING", str, "clusters", "clusters or pages",
            "What narrows a history longer than twice KVREEL_RETRIEVAL_CANDIDATES times the budget before a "
            "prefill chunk's step scores its tokens: clusters (the DRE's, ranked by centroid and by their "
            "keys' bounds; the DRE runs beside the engine) or "
            "pages (every block ranked by the most its keys could score with the step's queries, from their "
            "channel-wise bounds, as Quest does; computed in the worker, no DRE).",
            _one_of("clusters", "pages")),
    Setting("RETRIEVAL_PREFILL_SELECT", str, "narrowed", "narrowed or always",
            "Which prefill chunks of a long request select from its history: narrowed (only where the history "
            "is at least twice KVREEL_RETRIEVAL_CANDIDATES times the budget, so clusters or pages narrow it; a "
            "chunk over a shorter history attends to all of it, exactly, which costs it less than scoring "
            "every history token for every query row) or always (every chunk selects, scoring every token "
            "where nothing narrows).", _one_of("narrowed", "always")),
    _int_setting("RETRIEVAL_ROWS_PER_SET", 8, "A long request's query rows (a prefill chunk's tokens) that share "
                 "one working set: a chunk's rows are attended to in groups this size, each with the history its "
                 "own queries select, so a question inside a chunk finds its needle. Smaller: closer to per-token "
                 "selection; larger: a faster prefill (every group's working set is copied out for the kernel).",
                 1, 1 << 20),
    _int_setting("RETRIEVAL_BUDGET_TOKENS", 1024, "Working set per long request and layer: the most history "
                 "tokens (sink block included) attended to in one step, whatever the share (1/8 of an 8 K "
                 "history fits; longer ones read a smaller share, so a decoding step's cost grows little with "
                 "the history); held in kvreel's buffer beside vLLM's cache (engine KV memory = paged cache + "
                 "working sets).", 32, 1 << 24),
    Setting("DRE_ADDRESS", _dre_address, None, "a Unix-socket path or host:port (unset: the worker starts its own "
            "DRE on a private Unix socket)", "Where the DRE service listens (`kvreel dre --address ...`)."),
    Setting("DRE_SECRET_HEX", _hex_secret, None, "an even number of hex digits, at least 32",
            "Shared secret between kvreel and the DRE service (HMAC challenge); unset: no authentication."),
)
SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


class _Loading:
    """How settings are read and checked; ``KVReelConfig`` adds one field per
    entry of ``SETTINGS`` (the setting's name in lower case)."""

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> "KVReelConfig":
        """Read ``KVREEL_*`` from ``env`` (default: os.environ), then apply
        ``overrides`` (kv_connector_extra_config: ``cpu_bytes`` or ``KVREEL_CPU_BYTES``)."""
        env = os.environ if env is None else env
        raw: dict[str, tuple[str, str]] = {}  # setting name -> (source label, text)
        for key, value in env.items():
            if key.startswith(PREFIX):
                raw[_known(key[len(PREFIX):], key)] = (key, value)
        for key, value in (overrides or {}).items():
            name = key[len(PREFIX):] if key.upper().startswith(PREFIX) else key.upper()
            raw[_known(name, key)] = (f"kv_connector_extra_config[{key!r}]", str(value))
        values = {}
        for setting in SETTINGS:
            if setting.name not in raw:
                values[setting.name.lower()] = setting.default
                continue
            source, text = raw[setting.name]
            try:
                value = setting.parse(text)
                ok = setting.check(value)
            except (ValueError, TypeError):
                ok = False
            if not ok:
                raise ConfigError(f"{source}={text!r} is invalid: expected {setting.accepts}")
            values[setting.name.lower()] = value
        cfg = cls(**values)
        cfg._check_combination()
        return cfg

    def _check_combination(self) -> None:
        needs = []   # (setting shown, module, pip package): a feature whose package is missing stops start-up here
        if self.remote_url and self.remote_url.startswith(("redis://", "rediss://", "redis-cluster://")):
            needs.append((f"{PREFIX}REMOTE_URL=redis://...", "redis", "redis"))
        if VIDEO_FORM in self.remote_forms:
            needs.append((f"{PREFIX}REMOTE_FORMS={','.join(self.remote_forms)}", "av", "av"))
        for shown, module, package in needs:
            try:
                importlib.import_module(module)
            except ImportError:
                raise ConfigError(f"{shown} needs the Python package {package!r}, which is not installed "
                                  f"(pip install {package}; kvreel depends on it)") from None
        if self.remote_quant != "none" and VIDEO_FORM not in self.remote_forms:
            raise ConfigError(f"{PREFIX}REMOTE_QUANT={self.remote_quant!r} quantizes the video form: "
                              f"add video to {PREFIX}REMOTE_FORMS")
        form = form_kind(self.fetch_form)
        if self.fetch_form != "auto" and form not in self.remote_forms:
            raise ConfigError(f"{PREFIX}FETCH_FORM={self.fetch_form!r} is not a stored form "
                              f"({PREFIX}REMOTE_FORMS={','.join(self.remote_forms)})")
        if form == VIDEO_FORM and form_resolution(self.fetch_form) not in self.remote_resolutions:
            raise ConfigError(f"{PREFIX}FETCH_FORM={self.fetch_form!r} is not a stored resolution "
                              f"({PREFIX}REMOTE_RESOLUTIONS={','.join(map(str, self.remote_resolutions))})")


def _value_type(parse: Callable[[str], Any]) -> Any:
    """What a setting's parser returns: the type of its config field."""
    return parse if isinstance(parse, type) else get_type_hints(parse)["return"]


KVReelConfig = make_dataclass(
    "KVReelConfig", [(s.name.lower(), _value_type(s.parse)) for s in SETTINGS], bases=(_Loading,), frozen=True,
    namespace={"__doc__": "kvreel's validated settings: ``cfg.cpu_bytes`` is KVREEL_CPU_BYTES, and so on.",
               "__module__": __name__})


def _known(name: str, shown: str) -> str:
    if name in SETTINGS_BY_NAME:
        return name
    close = difflib.get_close_matches(name, SETTINGS_BY_NAME, n=1, cutoff=0.5)
    hint = f"; did you mean {PREFIX}{close[0]}?" if close else ""
    raise ConfigError(f"unknown kvreel setting {shown!r}{hint} "
                      f"(valid: {', '.join(PREFIX + s for s in SETTINGS_BY_NAME)})")


def settings_table_markdown() -> str:
    """The env-var reference as a Markdown table (docs/configuration.md and deploy/README.md embed it)."""
    rows = ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "unset" if s.default is None else (
            format_bytes(s.default) if s.parse is parse_bytes else
            ",".join(map(str, s.default)) if isinstance(s.default, tuple) else str(s.default))
        rows.append(f"| `{PREFIX}{s.name}` | {default} | {s.accepts} | {s.doc} |")
    return "\n".join(rows)
