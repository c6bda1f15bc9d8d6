"""The DRE's wire: length-prefixed frames on a Unix-domain or TCP socket, each a
JSON message and the raw bytes of its tensors. When both ends share an IPC
namespace (same host, same container), a tensor goes through a POSIX
shared-memory segment the sender names and the receiver copies out and
unlinks; otherwise it travels inline, after the JSON. Nothing is pickled. With
a shared secret, a connection must first prove it (HMAC of a server nonce)."""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
import struct
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

_FRAME = struct.Struct("<II")    # JSON bytes, inline tensor bytes
MAX_MESSAGE = 1 << 20            # the JSON part; tensors travel beside it
MAX_TENSOR_BYTES = 1 << 30
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}


class DREError(RuntimeError):
    """The service refused a request, or is unreachable."""


# -- shared memory -------------------------------------------------------------

SHM_PREFIX = "kvreel-dre-"
SHM_DIR = "/dev/shm"           # where Linux lists this IPC namespace's POSIX shared memory
# kvreel-dre-<pid namespace>-<creator pid>-<random>: the creator is named so that its
# segments can be found once it is gone
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}(\d+)-(\d+)-[0-9a-f]{{16}}$")


@functools.cache
def _pid_namespace() -> str:
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def put_tensor(t: torch.Tensor) -> dict:
    """Copy a tensor into a new shared-memory segment; its descriptor (the
    receiver copies it out and unlinks the segment)."""
    arr = t.detach().cpu().contiguous().numpy()
    shm = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}",
                                     create=True, size=max(1, arr.nbytes))
    np.ndarray(arr.shape, arr.dtype, buffer=shm.buf)[...] = arr
    desc = {"shm": shm.name, "shape": list(arr.shape), "dtype": arr.dtype.name}
    # the receiver unlinks it; stop this process's tracker from unlinking it again at exit
    resource_tracker.unregister(shm._name, "shared_memory")
    shm.close()
    return desc


def segment_names(msg: dict) -> list[str]:
    """The shared-memory segments an encoded message hands its receiver."""
    return [v["shm"] for v in msg.values() if isinstance(v, dict) and "shm" in v]


def discard_segments(names: list[str]) -> None:
    """Unlink segments that their receiver will never take (it is gone, or the
    message was never sent): each holds memory until unlinked."""
    for name in names:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:           # taken after all
            continue
        shm.close()
        shm.unlink()


def discard_orphaned_segments(also: int | None = None) -> int:
    """Unlink the segments whose creator (in this PID namespace) is gone, and, with
    ``also``, those of that process (a DRE that exits with replies unread): a worker
    or a DRE that dies with messages in flight leaves them behind, holding memory
    until the host restarts. How many were unlinked."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    here, orphans = _pid_namespace(), []
    for name in names:
        m = _SHM_NAME.match(name)
        if m is None or m.group(1) != here:
            continue
        pid = int(m.group(2))
        if pid == also or not _alive(pid):
            orphans.append(name)
    discard_segments(orphans)
    return len(orphans)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                 # alive, another user's
        return True
    return True


def inline_tensor(t: torch.Tensor, blob: bytearray) -> dict:
    """Append a tensor's bytes to a frame's inline part; its descriptor."""
    arr = t.detach().cpu().contiguous().numpy()
    desc = {"at": len(blob), "shape": list(arr.shape), "dtype": arr.dtype.name}
    blob += arr.tobytes()
    return desc


def take_tensor(desc: dict, blob: bytes = b"") -> torch.Tensor:
    """A tensor a peer sent: copied out of the frame's inline bytes, or out of
    the named segment (then unlinked). Only segments named as ``put_tensor``
    names them are opened: a peer must not make this process read or delete
    anyone else's shared memory (vLLM's included)."""
    dtype = DTYPES.get(str(desc.get("dtype")))
    shape = [int(x) for x in desc.get("shape", [])]
    if dtype is None or any(x < 0 for x in shape):
        raise DREError(f"bad tensor descriptor {str(desc)[:120]}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise DREError(f"tensor of {nbytes} bytes exceeds the {MAX_TENSOR_BYTES}-byte limit")
    if "at" in desc:
        at = int(desc["at"])
        if at < 0 or at + nbytes > len(blob):
            raise DREError("inline tensor outside its frame")
        return torch.from_numpy(np.frombuffer(blob, dtype, count=nbytes // np.dtype(dtype).itemsize,
                                              offset=at).reshape(shape).copy())
    if not _SHM_NAME.match(str(desc.get("shm"))):
        raise DREError(f"refused shared-memory segment {str(desc.get('shm'))[:80]!r}: not one kvreel created")
    shm = shared_memory.SharedMemory(name=str(desc["shm"]))
    try:
        if shm.size < nbytes:
            raise DREError("shared-memory segment smaller than its descriptor")
        out = torch.from_numpy(np.ndarray(shape, dtype, buffer=shm.buf).copy())
    finally:
        shm.close()
        shm.unlink()
    return out


def ipc_namespace() -> str | None:
    """This process's IPC namespace (with the host's boot id): shared-memory
    segments reach exactly the processes that report the same."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/ipc')}"
    except OSError:
        return None


def encode_tensors(msg: dict, inline: bool) -> tuple[dict, bytes]:
    """A message's tensors as shared-memory descriptors, or inline after its JSON."""
    blob = bytearray()
    out = {k: (inline_tensor(v, blob) if inline else put_tensor(v)) if isinstance(v, torch.Tensor) else v
           for k, v in msg.items()}
    return out, bytes(blob)


def decode_tensors(msg: dict, blob: bytes) -> dict:
    return {k: take_tensor(v, blob) if isinstance(v, dict) and ("shm" in v or "at" in v) else v
            for k, v in msg.items()}


# -- framing -------------------------------------------------------------------

def send_msg(sock: socket.socket, msg: dict, blob: bytes = b"") -> None:
    raw = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(len(raw), len(blob)) + raw + blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("connection closed")
        buf += part
    return bytes(buf)


def recv_msg(sock: socket.socket, max_blob: int = MAX_TENSOR_BYTES) -> tuple[dict, bytes]:
    """A message and its inline tensor bytes (at most ``max_blob`` of them)."""
    n, nblob = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if n > MAX_MESSAGE:
        raise DREError(f"message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit")
    if nblob > max_blob:
        raise DREError(f"{nblob} inline bytes exceed the {max_blob}-byte limit")
    msg = json.loads(_recv_exact(sock, n))
    if not isinstance(msg, dict):
        raise DREError("message is not a JSON object")
    return msg, _recv_exact(sock, nblob) if nblob else b""


SECRET_MIN_HEX = 32          # a shared secret's least length in hex digits (16 bytes)


def parse_secret_hex(text: str | None) -> bytes | None:
    """The shared secret ``KVREEL_DRE_SECRET_HEX`` names (None: unset); ValueError
    unless it is an even number of hex digits, at least ``SECRET_MIN_HEX``."""
    if not text:
        return None
    if len(text) < SECRET_MIN_HEX:
        raise ValueError(f"needs at least {SECRET_MIN_HEX} hex digits, got {len(text)}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError("is not an even number of hex digits") from None


def proof(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, nonce.encode(), "sha256").hexdigest()


def is_private(address: str) -> bool:
    """A Unix socket (file permissions guard it) or a loopback TCP address."""
    if "/" in address:
        return True
    host = address.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def listen(address: str) -> socket.socket:
    if "/" in address:
        if os.path.exists(address):
            os.unlink(address)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        os.chmod(address, 0o600)
    else:
        host, _, port = address.rpartition(":")
        s = socket.create_server((host or "127.0.0.1", int(port)))
    s.listen(16)
    return s


def connect(address: str, timeout: float) -> socket.socket:
    if "/" in address:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(address)
    else:
        host, _, port = address.rpartition(":")
        s = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout)
    s.settimeout(None)
    return s
