#!/usr/bin/env bash
# The demo model's cost of explanations (issue 23): the demo job as shipped (`explain:
# {method: permutation, samples: 4, top_k: 5, fraction: 0.1}`) against the same job and model
# without `explain` (the model copied and stamped without it), at ~1M rows, alternating, each a
# fresh `python -m batchinfer run --overwrite`. Prints each run's wall time and
# stage_seconds_explain.
#
#   bench/explain_demo.sh [WORKDIR] [ROUNDS]      # default /tmp/explain_demo, 3 rounds
set -euo pipefail
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
work=${1:-/tmp/explain_demo}
rounds=${2:-3}
rm -rf "$work" && mkdir -p "$work" && cd "$work"
"$PY" -m batchinfer demo --rows 999996 > demo.log 2>&1   # 6 equal shards
cd demo
cp models/credit_risk.onnx models/plain.onnx
grep -v '^explain:' job.yaml | sed 's#models/credit_risk.onnx#models/plain.onnx#; s#out/dt={ds}#out_plain/dt={ds}#' > job_plain.yaml
"$PY" -m batchinfer stamp models/plain.onnx --job job_plain.yaml --model-version credit_risk:1 > stamp.log
for r in $(seq "$rounds"); do
  for job in job.yaml job_plain.yaml; do
    start=$(date +%s.%N)
    "$PY" -m batchinfer run "$job" --ds 2026-01-31 --overwrite --quiet > "run-$job-$r.log" 2>&1
    end=$(date +%s.%N)
    out=$([ "$job" = job.yaml ] && echo out || echo out_plain)
    explain=$(grep -o '"stage_seconds_explain": [0-9.]*' "$out/dt=2026-01-31/_metrics.json" || echo "no explain")
    echo "$job round $r: wall $(python3 -c "print(round($end - $start, 2))") s, load $(cut -d' ' -f1 /proc/loadavg), $explain"
  done
done
