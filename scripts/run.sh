#!/usr/bin/env bash
# Quick start, command 1: create .venv, install everything, start the main job.
# Extra arguments go to the main job.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv "" background  # the kernels build while `up` installs the model; the target waits for them
exec "$VENV/bin/specserve" up "$@"
