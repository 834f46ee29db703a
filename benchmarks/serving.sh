#!/usr/bin/env bash
# Serving benchmarks (issue 4): `pipeserve up` on the demo model, driven by `pipeserve bench`.
# Appends every run to benchmarks/RESULTS.md. Usage: benchmarks/serving.sh [quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PS=.venv/bin/pipeserve
export PIPESERVE_HOME=${PIPESERVE_HOME:-/tmp/psbench}
MODEL=$($PS demo-model "$PIPESERVE_HOME/demo-model" 2>/dev/null || echo "$PIPESERVE_HOME/demo-model")
N=${N:-200}
[ "${1:-}" = quick ] && N=20
OUT=benchmarks/RESULTS.md
LOGS=$(mktemp -d)

up() {  # up LABEL ARGS...: start pipeserve up, wait for its line, run the rest of the script's benches
  local port=18000
  $PS up --model "$MODEL" --port $port --log-dir "$LOGS" "$@" >"$LOGS/up.out" 2>"$LOGS/up.err" &
  UP_PID=$!
  for _ in $(seq 1 300); do grep -q "pipeserve: serving" "$LOGS/up.out" && break; sleep 0.2; done
  grep -q "pipeserve: serving" "$LOGS/up.out" || { cat "$LOGS/up.err"; exit 1; }
  URL=http://127.0.0.1:$port
  GRPC=$(curl -s $URL/groups | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["grpc"])')
}
down() { kill -TERM "$UP_PID"; wait "$UP_PID" || true; }
bench() { $PS bench --url "$URL" --tokenizer "$MODEL" --results-md "$OUT" "$@"; }

up --stages 1
bench --router-overhead --grpc "$GRPC" --num-requests "$N" --label "router overhead, demo model, S=1 R=1"
down

up --stages 2
bench --workload random --num-requests "$N" --concurrency 16 --input-len 128 --output-len 64 \
  --label "random 128/64, C=16, demo model, S=2 R=1"
bench --workload shared-prefix --num-requests "$N" --concurrency 16 --input-len 64 --output-len 64 \
  --shared-prefix-len 256 --num-prefixes 4 --label "shared-prefix 256+64/64, C=16, demo model, S=2 R=1"
down

for policy in round_robin prefix_affinity; do
  up --stages 1 --replicas 2 --policy $policy
  bench --workload shared-prefix --num-requests "$N" --concurrency 16 --input-len 64 --output-len 64 \
    --shared-prefix-len 256 --num-prefixes 4 --label "shared-prefix 256+64/64, C=16, demo model, S=1 R=2 $policy"
  down
done
rm -rf "$LOGS"
