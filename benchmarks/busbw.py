"""Bus bandwidth of the hand-built ring all-reduce against native gloo (issue 3, §3).

Runs ``labkit bench collectives`` with its defaults — all-reduce, world sizes 2 and 4,
1 KiB … 64 MiB in powers of 4, native and ring side by side, 8 interleaved rounds per
point (median) — and prints the table, then one line per size of 16 MiB and above:

    RESULT ring_vs_native_busbw_16MiB <lowest ratio over the world sizes>
    RESULT ring_vs_native_busbw_16MiB_N2 <ratio at N=2>   (and _N4, …)

Goal: ratio >= 0.8. busbw is nccl-tests' definition (``labkit.collectives.bench``). The
numbers are wall-clock timings of rank processes sharing the machine's cores: run it on an
otherwise idle machine (the load average is printed first). Each ratio's 90 % bootstrap
interval over the rounds follows; on a busy 2-core machine one run's ratio moves by ±30 %.
Any ``labkit bench collectives`` option may be passed through (e.g. ``--world-size 8``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from labkit.collectives import bench  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load} on {os.cpu_count()} cores", flush=True)
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
