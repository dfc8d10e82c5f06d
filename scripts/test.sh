#!/usr/bin/env bash
# Quick start, command 2: install the test extras and run the whole suite (CI's command).
#   bash scripts/test.sh            the full tier: ruff, mypy, every test (tests/unit, tests/service, tests/stack)
#   bash scripts/test.sh --fast     the fast tier: ruff, mypy, tests/unit (no processes, no sockets) and the
#                                   tests marked fast in tests/service and tests/stack (the one request end
#                                   to end); a few minutes
# Other arguments go to pytest.
tier=()
if [ "${1:-}" = "--fast" ]; then
    shift
    # tests/conftest.py marks every test in tests/service and tests/stack slow unless it is marked fast, so
    # this is tests/unit and those marked fast (paths given after --fast narrow it, as for the full tier)
    tier=(-m "not slow")
    what="the fast tier: tests/unit, and the tests marked fast in tests/service and tests/stack"
else
    what="the full tier: tests/unit, tests/service, tests/stack"
fi
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ensure_venv test
cd "$ROOT"
# The deployment tests use real tools: a compose implementation (`config`), Prometheus and promtool,
# kubectl (`kustomize`). Installed from Debian's packages when this runs as root with apt-get (CI);
# elsewhere the tests that need one skip, saying which package would bring it.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
    command -v promtool >/dev/null || missing+=(prometheus)
    command -v kubectl >/dev/null || missing+=(kubernetes-client)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "[specserve] installing ${missing[*]} (Debian packages, for the deployment tests)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}"; } >/dev/null || echo "[specserve] could not install ${missing[*]}: those tests skip"
    fi
fi
echo "[specserve] ruff check"
"$VENV/bin/ruff" check .
echo "[specserve] mypy (the whole package: services/ and shared/)"
"$VENV/bin/mypy" -p specserve
echo "[specserve] import-linter (the layering contracts in pyproject.toml)"
PYTHONPATH="$ROOT/.mypy_path" "$VENV/bin/lint-imports" --no-cache
echo "[specserve] pytest, $what"
exec "$VENV/bin/python" -m pytest "${tier[@]}" "$@"
