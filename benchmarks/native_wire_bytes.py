"""Native collectives' bytes on the wire, measured, beside the ring formula labkit.comm records.

labkit.comm labels a native collective's bytes ``"formula"`` because they are not measured.
This measures them where that can be done honestly on one machine: gloo talks TCP over the
loopback interface, whose transmit counter (``/proc/net/dev``, ``lo``) counts every byte each
rank sends. Around ``reps`` calls of each op (16 MiB, 2 and 4 ranks):

    measured per rank per call = (Δ tx − Δ tx of an idle window of the same length) / reps / N

Overhead included in "measured": TCP/IP headers (about 66 B per segment; loopback segments
are up to 64 KiB, so ~0.1 %), gloo's own small control messages, and the barrier that closes
the window. Other processes' loopback traffic is subtracted by the idle window only on
average: on a shared machine the figure moves, so run it on an idle one (the load average is
printed first). Prints one line per point and ``RESULT wire_over_formula_<op>_N<n> <ratio>``.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

MiB = 2**20


def main() -> int:
    import labkit

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load} on {os.cpu_count()} cores", flush=True)
    for n in (2, 4):
        with labkit.Cluster(n, backend="gloo", device="cpu") as cluster:
            rows = cluster.run("benchjobs.wire:wire_bytes", {"reps": 8, "nbytes": 16 * MiB},
                               timeout_s=600).outputs[0]
        for r in rows:
            per_rank = (r["busy"] - r["idle"]) / r["reps"] / n
            ratio = per_rank / r["formula_per_rank"]
            print(f"{r['op']:<15} N={n}  formula {r['formula_per_rank'] / MiB:8.3f} MiB/rank  "
                  f"measured {per_rank / MiB:8.3f} MiB/rank  (idle window "
                  f"{r['idle'] / MiB:.3f} MiB)  ratio {ratio:.3f}")
            print(f"RESULT wire_over_formula_{r['op']}_N{n} {ratio:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
