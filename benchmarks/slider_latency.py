"""Slider release → redrawn figures, for the explorer on the tiny model.

Drives ``labkit_widgets.Explorer`` headlessly: each ``explorer.set(dp=...)`` goes through the
same observe path as a released slider (build config → validate → ``cluster.run`` → one
``batch_update`` of every figure), and ``explorer.last_latency_s`` is the time from the
change to the figures holding the new values. Target: ≤ 1 s on a 2-core machine.

Prints a table and ``RESULT slider_latency_median_s <x>`` / ``RESULT slider_latency_p90_s <x>``.
"""
from __future__ import annotations

import statistics
import time

import torch


def main(repeats: int = 6) -> dict:
    import labkit as lk
    from labkit_widgets import Explorer

    torch.set_num_threads(1)
    with lk.Cluster(world_size=4) as cluster:
        ex = Explorer(cluster, lk.RunConfig(model="tiny", steps=3, global_batch=8).replace(dp=4))
        for dp in (2, 1, 4):  # first use of each shape counts FLOPs and calibrates: warm up
            ex.set(dp=dp)
        rows = []
        for i in range(repeats):
            for dp in (2, 4, 1):
                t0 = time.perf_counter()
                ex.set(dp=dp)
                outer = time.perf_counter() - t0
                rows.append((dp, ex.last_latency_s, ex.last_result.wall_s, outer))
    lat = sorted(r[1] for r in rows)
    print(f"{'dp':>3} {'latency s':>10} {'cluster.run s':>14}")
    for dp, latency, wall, _ in rows:
        print(f"{dp:>3} {latency:>10.3f} {wall:>14.3f}")
    med, p90 = statistics.median(lat), lat[int(0.9 * (len(lat) - 1))]
    print(f"RESULT slider_latency_median_s {med:.3f}")
    print(f"RESULT slider_latency_p90_s {p90:.3f}")
    return {"median": med, "p90": p90}


if __name__ == "__main__":
    main()
