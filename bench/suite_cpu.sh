#!/usr/bin/env bash
# The test suite's wall time and how busy the machine's cores were meanwhile (issue 19): the
# suite is CPU-bound in its two processes, so CPU seconds are what a cut must save.
#
#   bench/suite_cpu.sh OUT [pytest arguments]     # e.g. bench/suite_cpu.sh /tmp/suite.txt -n 2 --durations=0 -q
#
# pytest's output goes to OUT; the last line printed (and appended to OUT.cpu) is
# "wall S busy_share F busy_cpu_s C": busy jiffies over all jiffies of /proc/stat between start
# and end (the whole machine: run it on an otherwise idle one).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1; shift
busy() { read -r _ u n s i w q sq st _ < <(grep '^cpu ' /proc/stat); echo "$((u+n+s+q+sq+st)) $((u+n+s+i+w+q+sq+st))"; }
read -r b0 t0 < <(busy); s0=$(date +%s.%N)
rc=0; .venv/bin/python -m pytest "$@" > "$out" 2>&1 || rc=$?
read -r b1 t1 < <(busy); s1=$(date +%s.%N)
hz=$(getconf CLK_TCK)
line=$(python3 -c "print(f'wall {$s1-$s0:.1f} busy_share {($b1-$b0)/($t1-$t0):.3f} busy_cpu_s {($b1-$b0)/$hz:.0f}')")
echo "$line" | tee -a "$out.cpu"
exit $rc
