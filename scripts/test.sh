#!/usr/bin/env bash
# Quick start, command 2: install the test extras and run the whole suite.
# Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv test
cd "$ROOT"
echo "[specserve] ruff check"
"$VENV/bin/ruff" check .
echo "[specserve] mypy (the gateway and shared/)"
"$VENV/bin/mypy" -p specserve.gateway -p specserve.shared
exec "$VENV/bin/python" -m pytest "$@"
