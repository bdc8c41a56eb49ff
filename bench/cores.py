"""How many cores' worth of throughput this machine's CPUs deliver together.

    python bench/cores.py            # every usable CPU, 5 trials (the speed of a shared VM drifts: the median counts)

A cloud VM's vCPUs may be hyperthreads of one physical core, or share it with other tenants: then a
second busy process slows the first, and every CPU-microsecond the API process and a co-located
benchmark client spend per token comes off the engine, whatever the scheduler does. This runs the
same pure-Python loop (the engine's step loop is Python-bound on small models) in one process alone,
then in one process per usable CPU at once, each pinned to its own CPU, and prints the slowdown and
the effective number of cores (N / slowdown; N on a machine whose CPUs are independent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

LOOP = """
import os, sys, time
os.sched_setaffinity(0, {%d})
start = time.perf_counter()
total = 0
for i in range(%d):
    total += i * i
print(time.perf_counter() - start)
"""


def timed(cpus: list[int], iterations: int) -> list[float]:
    """Seconds each process took, all started together, one per CPU in ``cpus``."""
    procs = [subprocess.Popen([sys.executable, "-c", LOOP % (cpu, iterations)], stdout=subprocess.PIPE, text=True)
             for cpu in cpus]
    return [float(p.communicate(timeout=600)[0]) for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=6_000_000)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{len(cpus)} usable CPUs: {cpus}")
    slowdowns = []
    for trial in range(args.trials):
        alone = timed(cpus[:1], args.iterations)[0]
        together = timed(cpus, args.iterations)
        slowdowns.append(max(together) / alone)
        print(f"trial {trial}: one process alone {alone:.2f} s; {len(cpus)} at once {max(together):.2f} s "
              f"(slowest) -> slowdown {slowdowns[-1]:.2f}x, {len(cpus) / slowdowns[-1]:.2f} cores of throughput")
    median = statistics.median(slowdowns)
    print(f"median slowdown {median:.2f}x: {len(cpus)} CPUs deliver {len(cpus) / median:.2f} cores of throughput")


if __name__ == "__main__":
    main()
