#!/usr/bin/env bash
# bench/gpu_suite.py on a lent GPU machine: install the carried wheels (scripts/device_wheels.sh) beside the
# image's packages, then run the suite with the arguments given (e.g. --out-dir "$OUT").
set -eo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
exec python3 bench/gpu_suite.py "$@"
