# Sourced by scripts/run.sh and scripts/test.sh: create .venv and install specserve into it.
# Usage: ensure_venv [EXTRAS] [BUILD]   (EXTRAS like "test"; empty for the runtime only. BUILD "background":
# return while the CPU kernels still build; a process that loads them waits on the build's lock.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECSERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

# pip, minus the machine's noise about local index folders that do not exist.
_pip() {
    local py="$1"; shift
    "$py" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}

ensure_venv() {
    local extras="${1:-}" build="${2:-wait}"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[specserve] creating virtual environment in $VENV"
        "$PY" -m venv "$VENV"
    fi
    local pip=(_pip "$VENV/bin/python")
    # torch first and pinned: the CPU build of 2.13.0 is found locally. An unpinned torch would
    # pull the newest CUDA build (gigabytes).
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
        echo "[specserve] installing torch==2.13.0 (CPU build)"
        "${pip[@]}" install "torch==2.13.0"
    fi
    local spec="$ROOT"
    [ -n "$extras" ] && spec="$ROOT[$extras]"
    echo "[specserve] installing specserve${extras:+[$extras]} (editable)"
    "${pip[@]}" install -e "$spec"
    # The compiled CPU operators (shared/runtime/kernels), cached; where they cannot be built the torch pass runs.
    # Built beside the unpacking below (one compiler process: the other core is free).
    "$VENV/bin/specserve" kernels build &
    local builder=$!
    # The bundled models' weights are committed xz-compressed (models/README.md); written out once.
    "$VENV/bin/specserve" models unpack >/dev/null
    if [ "$build" != background ]; then wait "$builder"; fi
}
