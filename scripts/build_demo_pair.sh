#!/usr/bin/env bash
# Rebuild the bundled demo pair (models/) and the workload prompts (bench/workloads/) from scratch.
# Arguments go to `python -m training.build_demo_pair` (e.g. --stage evaluate). See models/README.md.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv
cd "$ROOT"
exec "$VENV/bin/python" -m training.build_demo_pair "$@"
