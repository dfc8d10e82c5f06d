#!/bin/bash
# SIMULATED replica scaling and gateway CPU on a many-core machine (the device machine's CPUs; no GPU use)
set -u
PY=${PY:-python3}
if [ -d .whl ] && [ -z "${LOCAL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/specserve
for e in services/*; do ln -s "$PWD/$e" /tmp/pkg/specserve/; done
ln -s "$PWD/shared" /tmp/pkg/specserve/shared
export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nproc; $PY -c "import os; print('cpus', os.cpu_count())"
ROUNDS=${ROUNDS:-3}; DUR=${DUR:-10}; GRID=${GRID:-10,14,18,22,26,30}
timeout ${T3:-420} $PY bench/replica_scale.py --targets 4,8 --rounds $ROUNDS --duration-s $DUR --per-replica $GRID \
  --gateway-args "--slo-class critical=100:2000 --slo-class search=200:4000 --slo-class chat=200:10000" \
  --out $OUT/replica_scale-16cores.json 2>&1 | tail -40
if [ -n "${T1:-}" ]; then
  for fe in 0 4; do
    timeout $T1 $PY bench/sim_scale.py --targets 8 --batches 32,128 --runs 1 --gateway-args "--frontends $fe" \
      --out $OUT/sim_scale-16cores-fe$fe.json 2>&1 | grep "^run"
  done
fi
