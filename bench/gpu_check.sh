#!/usr/bin/env bash
# The GPU check, as one prepared command (issue: GPU scoring). On the GPU machine, whose python3
# has PyTorch with CUDA but not Beam, pandera, polars or MLflow, carry .whl (made here by
# bench/gpu_wheels.sh) and run:
#
#   bench/gpu_check.sh                  # conformance GPU cases for torch, then bench/gpu_check.py
#   bench/gpu_check.sh --device cpu     # the same on the CPU (what the test suite runs, --quick)
#   --no-conformance                    # not the conformance cases: the test suite runs them itself
#
# Environment: PYTHON (default python3); OUT, when set, receives results.json and the logs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
device=cuda
extra=()
conformance=1
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --quick) extra+=(--quick); shift ;;
    --no-conformance) conformance=0; shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# The packages and torch's version line in one interpreter (Beam's import and torch's cost
# seconds each): exit 3 if Beam, pandera, polars or pydantic failed to import (then the carried
# packages are extracted and it runs once more), 4 if torch did.
check='import sys, traceback
try:
    import apache_beam, pandera.polars, polars, pydantic
except Exception:
    traceback.print_exc()
    sys.exit(3)
try:
    import torch
except Exception:
    traceback.print_exc()
    sys.exit(4)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
rc=0
{ errors=$("$PY" -c "$check" 2>&1 >&3) || rc=$?; } 3>&1   # its stderr held back: see below
if [ "$rc" = 3 ] && [ -f .whl/site.tar.xz ]; then   # its stderr dropped: the second try's shows
  mkdir -p /tmp/site && tar -xJf .whl/site.tar.xz -C /tmp/site   # the carried packages
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
  rc=0
  "$PY" -c "$check" || rc=$?
elif [ -n "$errors" ]; then
  printf '%s\n' "$errors" >&2
fi
if [ "$rc" = 3 ] || [ "$rc" = 4 ]; then
  echo "gpu_check.sh: packages missing: run bench/gpu_wheels.sh on the build machine and carry .whl" >&2
  exit 2
elif [ "$rc" != 0 ]; then   # the imports passed, the version line failed: its exit code
  exit "$rc"
fi
if [ "$device" = cuda ]; then
  selection=(-m gpu -k torch)        # the GPU cases of the conformance suite, torch backend
else
  selection=(-m "not gpu and not slow" -k "torch-cpu")
fi
if [ "$conformance" = 1 ]; then
  echo "== conformance suite (${selection[*]})"
  "$PY" -m pytest tests/conformance/test_backends.py "${selection[@]}" -q -p no:cacheprovider \
    ${OUT:+--junitxml "$OUT/conformance.xml"}
else
  echo "== conformance suite (${selection[*]}): not run (--no-conformance)"
fi
echo "== model alone vs batchinfer run ($device)"
"$PY" bench/gpu_check.py --device "$device" "${extra[@]}" ${OUT:+--out "$OUT"}
