#!/usr/bin/env python3
"""Run a command; report its wall time, CPU time and peak memory as one JSON line.

  python bench/rss.py OUT.json CMD [ARGS...]

The fallback for machines without GNU ``/usr/bin/time``: ``getrusage(RUSAGE_CHILDREN)`` in this
small process covers only the one child (and what it waited for), so its ``ru_maxrss`` is that
child's peak — the same figure ``/usr/bin/time -v`` reports as "Maximum resident set size".
The exit status of the command is this script's exit status.
"""
import json
import resource
import subprocess
import sys
import time


def main() -> int:
    out, cmd = sys.argv[1], sys.argv[2:]
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out, "w") as f:
        json.dump({"rc": rc, "wall_s": wall, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
                   "max_rss_kb": ru.ru_maxrss}, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
