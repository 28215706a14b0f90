#!/bin/bash
# One lent-GPU session's checks, each step time-boxed so the whole fits one device call (~9 minutes):
# tools/gpu_session.sh OUT_DIR. Logs and JSON land in OUT_DIR; a failing step does not stop the next.
out=${1:-gpu-session}; mkdir -p "$out"; rc=0
export PYTHONPATH=.gpu-site:$PYTHONPATH PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local r=$?; [ $r -ne 0 ] && rc=1
  echo "   rc=$r in $((SECONDS - t0)) s"; tail -n 8 "$out/$name.log"; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
make --no-print-directory gpu-site > "$out/gpu-site.log" 2>&1 || { echo "gpu-site failed"; cat "$out/gpu-site.log"; }
# NIXL, when `make gpu-nixl` packed it here and the call carries .nixl
if [ -f .nixl/nixl-cp312.tgz ]; then mkdir -p /tmp/nixl-site && tar xzf .nixl/nixl-cp312.tgz -C /tmp/nixl-site \
  && export PYTHONPATH=$PYTHONPATH:/tmp/nixl-site; fi
step test-gpu 270 python3 -m pytest -q -rs -p no:cacheprovider --timeout 240 tests/gpu
step bench-gpu 110 python3 -m benchmarks.engine_throughput_gpu --json "$out/gpu-bench.json"
step structured 80 python3 -m benchmarks.structured --device cuda --json "$out/structured-cuda.json"
step kv-transfer 60 python3 -m benchmarks.kv_transfer --blocks 16,64,256 --reps 3 --json "$out/kv-transfer.json"
step sliding 70 python3 -m benchmarks.engine_throughput_gpu --case sliding --reps 1 --json "$out/gpu-sliding.json"
exit $rc
