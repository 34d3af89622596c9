#!/usr/bin/env bash
# Spark GPU discovery script: prints this machine's NVIDIA GPUs in Spark's resource format,
# e.g. {"name": "gpu", "addresses": ["0", "1"]}. Point spark.executor.resource.gpu.discoveryScript
# (and spark.worker.resource.gpu.discoveryScript on standalone workers) at it.
set -euo pipefail
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo '{"name": "gpu", "addresses": []}'
  exit 0
fi
ADDRS=$(nvidia-smi --query-gpu=index --format=csv,noheader | sed -e 's/^ *//' -e 's/^/"/' -e 's/$/"/' | paste -sd, -)
echo "{\"name\": \"gpu\", \"addresses\": [${ADDRS}]}"
