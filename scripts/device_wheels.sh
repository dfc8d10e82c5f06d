#!/usr/bin/env bash
# Fetch, into .whl/ (ignored), the wheels a lent GPU machine lacks for bench/gpu_suite.py: its image has
# torch, transformers, triton, aiohttp, uvloop, httpx, prometheus-client and numpy (Python 3.12), not these.
# Then, with the device tool: run `bash bench/gpu_suite.sh --out-dir "$OUT"` with carry [".whl"].
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS=(msgspec opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
        opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto
        googleapis-common-protos importlib-metadata)
mkdir -p .whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
du -sh .whl
