"""Slider release → redrawn figures, for the explorer on the tour's 4-rank cluster.

Drives ``labkit_widgets.Explorer`` headlessly through the observe path a released slider
takes (``explorer.controls[name].value = v``: build the config → validate →
``cluster.run(labkit.jobs.train, …)`` → one ``batch_update`` of every figure), over a
dozen moves of dp, ZeRO, pp and the schedule, twice: the first pass meets most
configurations for the first time (the memory-tracked step runs), the second revisits
them (the explorer shows the memory it measured then and skips that step). The latency
of a move is ``explorer.last_latency_s``: from the change to the figures holding the new
values. ``cluster.run`` is the job's share; the rest is validation, the pipeline report
and drawing. The options of every control are recomputed after the figures (``after s``).

Goal (issue: slider → figure): p90 ≤ 0.5 s. The numbers depend on the machine's load:
the script prints the load average before and after.

Prints a table and ``RESULT slider_latency_{p50,p90}_s`` (all moves) and the same for
each pass.

    .venv/bin/python benchmarks/slider_latency.py [--passes 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

#: the moves, in order, from dp=4 (each value must be on offer where the move happens)
MOVES = (("dp", 2), ("zero_stage", 3), ("zero_stage", 0), ("dp", 1), ("pp", 2),
         ("schedule", "gpipe"), ("schedule", "interleaved"), ("schedule", "1f1b"),
         ("pp", 1), ("dp", 4), ("zero_stage", 2), ("zero_stage", 0))


def _pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(passes: int = 2) -> dict:
    import labkit as lk
    from labkit_widgets import Explorer
    from labkit_widgets.explorer_figures import layout_string

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    rows = []
    with lk.Cluster(world_size=4) as cluster:
        ex = Explorer(cluster, lk.RunConfig(model="tiny", steps=3, global_batch=8).replace(dp=4))
        if ex.last_error is not None:
            raise SystemExit(f"the first run failed: {ex.last_error}")
        # the first run of each shape counts FLOPs and calibrates the peak: warm those up
        # outside the timing, then come back to dp=4 and forget what was measured
        for name, v in MOVES:
            ex.controls[name].value = v
        ex._memory.clear()
        for p in range(passes):
            for name, v in MOVES:
                offered = [o[1] for o in ex.controls[name].options]
                if v not in offered:
                    raise SystemExit(f"{name}={v} is not offered here ({offered}): "
                                     f"{ex.unavailable.value}")
                n = len(ex.history)
                t0 = time.perf_counter()
                ex.controls[name].value = v  # the observe path of a released slider
                outer = time.perf_counter() - t0
                if ex.last_error is not None or len(ex.history) == n:
                    raise SystemExit(f"{name}={v} failed: {ex.last_error}")
                cfg = ex.last_result.config
                rows.append({"pass": p + 1, "move": f"{name}={v}", "layout": layout_string(cfg),
                             "revisit": not cfg.measure_memory, "latency": ex.last_latency_s,
                             "run": ex.last_result.wall_s, "after": outer - ex.last_latency_s})
    load1 = os.getloadavg()
    print(f"{'pass':>4} {'move':<22} {'layout':<26} {'memory':<8} {'latency s':>9} "
          f"{'cluster.run s':>13} {'after s':>8}")
    for r in rows:
        print(f"{r['pass']:>4} {r['move']:<22} {r['layout']:<26} "
              f"{'reused' if r['revisit'] else 'tracked':<8} {r['latency']:>9.3f} "
              f"{r['run']:>13.3f} {r['after']:>8.3f}")
    out = {}
    for label, sel in [("", rows)] + [(f"_pass{p + 1}", [r for r in rows if r["pass"] == p + 1])
                                      for p in range(passes)]:
        lat = [r["latency"] for r in sel]
        out[label] = (statistics.median(lat), _pct(lat, 0.9))
        print(f"RESULT slider_latency{label}_p50_s {out[label][0]:.3f}")
        print(f"RESULT slider_latency{label}_p90_s {out[label][1]:.3f}")
    print(f"load average (1 min) before {load0[0]:.1f}, after {load1[0]:.1f} on "
          f"{os.cpu_count()} cores")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    main(ap.parse_args().passes)
