#!/usr/bin/env bash
# Quick start, command 1: create .venv, install everything, start the main job.
# Extra arguments go to the main job.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv
exec "$VENV/bin/specserve" up "$@"
