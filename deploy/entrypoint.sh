#!/bin/sh
# Start vLLM's OpenAI server on $MODEL with kvreel attached; extra arguments go to vLLM,
# and so do the words of $VLLM_EXTRA_ARGS (for settings a compose file cannot leave out).
set -eu
: "${MODEL:?set MODEL to the model path or name}"
# shellcheck disable=SC2086  # VLLM_EXTRA_ARGS is split into words on purpose
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 0.0.0.0 --port 8000 \
  --kv-transfer-config '{"kv_connector":"KVReelConnector","kv_connector_module_path":"kvreel.connector","kv_role":"kv_both"}' \
  "$@" ${VLLM_EXTRA_ARGS:-}
