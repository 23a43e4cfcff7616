"""Snapshots of the training state (labkit.snapshot): saved in one layout, resumed in another.

Oracles that do not share labkit's code:

* what a snapshot holds is read back with PyTorch's own converter
  (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: full tensors by key) and
  compared with the independent single-process reference (tests/oracle: its model, its
  AdamW) — the parameters and both Adam moments after the saved step;
* an interrupted run (2 steps, saved; then resumed for 2 in another layout) is compared
  with the uninterrupted 4-step run of the saving layout, on every rank's full parameters
  (gathered by the job's own return path, not by the snapshot code): bit for bit when the
  layout is the same, to fp32 reduction-order tolerance otherwise.

One warm 4-rank pool runs the whole matrix (tiny model, 2 + 2 steps); the bigger matrix and
the timings are ``benchmarks/checkpoint_io.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from labkit import jobs
from labkit.config import ModelConfig, RunConfig
from labkit.snapshot import folder
from labkit.snapshot.pieces import range_boxes

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, name="snap-tiny")
MOE = ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, n_experts=4, top_k=2,
                  aux_loss_weight=0.01, name="snap-moe")
#: FSDP2 on 4 ranks splits dim 0 in chunks of ⌈d₀/4⌉ rows: vocabulary 258 → 65, 65, 65, 63;
#: d_model 30 → 8, 8, 8, 6; d_ff 2 → 1, 1, 0, 0 (two ranks hold an empty shard)
UNEVEN = ModelConfig(n_layers=1, d_model=30, n_heads=3, seq_len=16, d_ff=2, vocab_size=258,
                     name="snap-uneven")
BASE = RunConfig(model=TINY, steps=4, global_batch=8, adam_eps=1e-6, measure_memory=False,
                 count_flops=False, return_state=True)
TOL = 2e-6  # fp32 reduction order after 2 AdamW steps at lr 1e-3 (measured ≤ 1.2e-7)

#: save layout → the layouts its snapshot is loaded into (the first is itself: bitwise).
#: Covers ZeRO 0-3, HSDP, TP, PP, EP and 4 → 2 ranks on both sides.
MATRIX = {
    "dp4": (dict(parallel=dict(dp=4)),
            ["dp4", "dp2xtp2-zero1", "pp2"]),
    "dp2xtp2-zero1": (dict(parallel=dict(dp=2, tp=2), zero_stage=1),
                      ["dp2xtp2-zero1", "dp4-zero3", "dp2"]),
    "pp2xdp2-zero3": (dict(parallel=dict(pp=2, dp=2), zero_stage=3),
                      ["pp2xdp2-zero3", "dp2xtp2-zero1", "hsdp2x2"]),
    "moe-dp2xep2": (dict(model=MOE, parallel=dict(dp=2, ep=2)),
                    ["moe-dp2xep2", "moe-dp2", "moe-dp2xep2-zero3"]),
    "fsdp2-uneven": (dict(model=UNEVEN, parallel=dict(dp=4), zero_stage=3, impl="torch"),
                     ["fsdp2-uneven", "uneven-dp2-zero1"]),
}
LAYOUTS = {
    "dp4": dict(parallel=dict(dp=4)), "dp2": dict(parallel=dict(dp=2)),
    "pp2": dict(parallel=dict(pp=2)), "dp4-zero3": dict(parallel=dict(dp=4), zero_stage=3),
    "dp2xtp2-zero1": MATRIX["dp2xtp2-zero1"][0],
    "pp2xdp2-zero3": MATRIX["pp2xdp2-zero3"][0],
    "hsdp2x2": dict(parallel=dict(dp=4), zero_stage=2, hsdp_replicas=2),
    # a MoE layout changes its objective with the token groups (dp × micro × cp), so the
    # MoE loads keep dp=2 and change ep and ZeRO
    "moe-dp2xep2": MATRIX["moe-dp2xep2"][0], "moe-dp2": dict(model=MOE, parallel=dict(dp=2)),
    "moe-dp2xep2-zero3": dict(model=MOE, parallel=dict(dp=2, ep=2), zero_stage=3),
    "fsdp2-uneven": MATRIX["fsdp2-uneven"][0],
    "uneven-dp2-zero1": dict(model=UNEVEN, parallel=dict(dp=2), zero_stage=1),
}

pytestmark = pytest.mark.distributed


# -- pure ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), ()])
def test_range_boxes_tile_any_range_contiguously(shape):
    n = max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
    ref = torch.arange(n).reshape(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            seen = []
            for fs, off, sz in range_boxes(shape, a, b):
                box = ref[tuple(slice(o, o + s) for o, s in zip(off, sz))] if shape else ref
                flat = box.reshape(-1)
                # a box is the contiguous flat range it claims
                assert flat.tolist() == list(range(fs, fs + flat.numel()))
                seen += flat.tolist()
            assert seen == list(range(a, b)), (shape, a, b)
    with pytest.raises(ValueError, match="outside"):
        range_boxes(shape, 0, n + 1)


# -- the matrix ------------------------------------------------------------------------
def _state(result) -> dict:
    """Every rank's full parameters, checked to agree where ranks overlap."""
    out: dict = {}
    for r, o in enumerate(result.outputs):
        for k, v in o["state"].items():
            if k in out:
                assert torch.equal(out[k], v), f"rank {r} disagrees on {k}"
            out[k] = v
    return out


@pytest.fixture(scope="module")
def saved(cluster4, tmp_path_factory):
    """Per save layout: the uninterrupted 4-step run and a 2-step run's snapshot."""
    root = tmp_path_factory.mktemp("snapshots")
    out = {}
    for name, (lay, _) in MATRIX.items():
        cfg = BASE.replace(**lay)
        full = cluster4.run(jobs.train, cfg)
        part = cluster4.run(jobs.train, cfg.replace(steps=2, save_dir=str(root / name)))
        out[name] = (cfg, full, part, folder.step_dir(root / name, 2))
    return out


def _pairs():
    return [(s, l) for s, (_, loads) in MATRIX.items() for l in loads]


def test_resume_matrix_matches_uninterrupted(cluster4, saved):
    """Each save layout × its load layouts: losses of steps 2–3 and the final parameters
    (every rank's) equal the uninterrupted run's — exactly in the same layout."""
    report = {}
    for s, l in _pairs():
        cfg, full, part, snap = saved[s]
        assert part.losses == full.losses[:2]
        res = cluster4.run(jobs.train, BASE.replace(**LAYOUTS[l], resume=str(snap)))
        a, b = _state(full), _state(res)
        assert set(a) == set(b)
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        ldiff = max(abs(x - y) for x, y in zip(res.losses, full.losses[2:]))
        report[f"{s} -> {l}"] = (diff, ldiff)
        m = res.metrics
        assert all(x["first_step"] == 2 for x in m)
        loaded = [x["snapshot"]["loaded"] for x in m]
        if s == l:
            assert all(x["same_layout"] for x in loaded)
            assert diff == 0 and ldiff == 0, (s, diff, ldiff)
        else:
            assert not any(x["same_layout"] for x in loaded)
            assert diff <= TOL and ldiff <= TOL, (s, l, diff, ldiff)
        # every rank read something, only from files the snapshot has, and the bytes add up
        files = json.loads((snap / folder.MANIFEST).read_text())["files"]
        for x in loaded:
            assert x["reads"] and set(x["reads"]) <= set(files), x["reads"]
            assert x["bytes_read"] == sum(x["reads"].values()) > 0
        if s == "pp2xdp2-zero3" and l == "hsdp2x2":
            _check_reshard_view(res, files)
    print("\nsave -> load: max |Δ state|, max |Δ loss|")
    for k, v in report.items():
        print(f"  {k}: {v[0]:.2e} {v[1]:.2e}")


def _check_reshard_view(res, files: dict) -> None:
    """The resharding view draws one band per (saved file, new rank) read, as wide as the
    bytes that rank reported reading from that file."""
    from labkit_widgets.snapshot_view import reshard_figure, reshard_links, snapshot_table

    links = reshard_links(res)
    want = sorted((int(f[2:].split("_")[0]), r, b) for r, m in enumerate(res.metrics)
                  for f, b in m["snapshot"]["loaded"]["reads"].items())
    assert sorted(links) == want
    # ZeRO-3 over pp2 x dp2 wrote every rank's file; each hsdp rank needs layers of both stages
    assert {s for s, _, _ in links} == {int(f[2:].split("_")[0]) for f in files}
    sankey = reshard_figure(res).data[0]
    assert sum(sankey.link.value) == sum(m["snapshot"]["loaded"]["bytes_read"]
                                         for m in res.metrics)
    assert len(sankey.node.label) == len(files) + len(res.metrics)
    table = snapshot_table(res)   # a resumed run: its load, one row per new rank
    assert table.count("<tr") == 1 + len(res.metrics) and "saved ranks" in table
    for m in res.metrics:
        saved = sorted(int(f[2:].split("_")[0]) for f in m["snapshot"]["loaded"]["reads"])
        assert f"<td style='padding:2px 8px;text-align:right'>{', '.join(map(str, saved))}</td>" in table


def _oracle_after(cfg, steps: int) -> dict:
    """The independent reference's parameters and AdamW moments after ``steps`` steps."""
    sys.path.insert(0, os.path.dirname(__file__))
    from oracle.model import forward
    from oracle.run import _unique, initial_params, token_groups

    from labkit.models.data import make_batch

    p = initial_params(cfg)
    opt = torch.optim.AdamW(_unique(p), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            eps=cfg.adam_eps)
    groups, n = token_groups(cfg)
    for step in range(steps):
        x, y = make_batch(cfg, step)
        obj, _, _ = forward(p, cfg.model_config, x, y, groups, n, record=[])
        opt.zero_grad(set_to_none=True)
        obj.backward()
        opt.step()
    out = {}
    for name, t in p.items():
        if name == "head.weight" and cfg.model_config.tie_embeddings:
            continue
        st = opt.state[t]
        out[f"model/{name}"] = t.detach()
        out[f"optim/exp_avg/{name}"] = st["exp_avg"]
        out[f"optim/exp_avg_sq/{name}"] = st["exp_avg_sq"]
        out[f"optim/step/{name}"] = st["step"]
    return out


def _oracle_switched(before, after, switch: int, steps: int) -> dict:
    """The independent reference trained ``switch`` steps with ``before``'s MoE token
    groups and then up to ``steps`` with ``after``'s (one AdamW throughout): what a run
    saved in ``before`` and resumed in ``after`` computes. ``{"losses", "state"}``."""
    sys.path.insert(0, os.path.dirname(__file__))
    from oracle.model import forward
    from oracle.run import _unique, initial_params, token_groups

    from labkit.models.data import make_batch

    p = initial_params(before)
    opt = torch.optim.AdamW(_unique(p), lr=before.lr, weight_decay=before.weight_decay,
                            eps=before.adam_eps)
    losses = []
    for step in range(steps):
        groups, n = token_groups(before if step < switch else after)
        x, y = make_batch(before, step)
        obj, lm, _ = forward(p, before.model_config, x, y, groups, n, record=[])
        opt.zero_grad(set_to_none=True)
        obj.backward()
        opt.step()
        losses.append(lm.item())
    return {"losses": losses, "state": {k: t.detach() for k, t in p.items()}}


def test_moe_resumed_with_other_token_groups_trains_the_stated_objective(cluster4, saved):
    """A MoE snapshot (dp2×ep2) resumed at dp4×ep2: the load-balancing loss and capacity are
    per token group (data rank × microbatch × context rank), so the objective changes with
    dp. What stays equal, and is checked: the resumed run is the independent reference
    trained 2 steps with the saving layout's groups, then 2 with the new layout's, from the
    loaded state (losses and every parameter, fp32 reduction-order tolerance). The change is
    warned about before launch, naming both groupings, and reported in the run's metrics;
    a layout that keeps the groups (ep, ZeRO: the matrix above) gets no warning."""
    import warnings

    cfg, full, part, snap = saved["moe-dp2xep2"]
    new = BASE.replace(model=MOE, parallel=dict(dp=4, ep=2), resume=str(snap))
    with pytest.warns(folder.ObjectiveChangeWarning,
                      match=r"dp=2, micro_batch=4, cp=1: 2 groups per step -> dp=4, "
                            r"micro_batch=2, cp=1: 4 groups"):
        res = cluster4.run(jobs.train, new)
    for m in res.metrics:
        assert "will not reproduce the uninterrupted run" in \
            m["snapshot"]["loaded"]["objective_change"]
    ref = _oracle_switched(cfg, new, 2, 4)
    state = _state(res)
    assert max(abs(a - b) for a, b in zip(res.losses, ref["losses"][2:])) <= TOL
    assert max((state[k] - ref["state"][k]).abs().max().item() for k in state) <= TOL
    # the reference itself: the same state under the other groups is another objective
    same = _oracle_switched(cfg, cfg, 2, 4)
    assert same["losses"][2:] != ref["losses"][2:]
    with warnings.catch_warnings():
        warnings.simplefilter("error", folder.ObjectiveChangeWarning)
        for name in ("moe-dp2", "moe-dp2xep2-zero3"):
            BASE.replace(**LAYOUTS[name], resume=str(snap)).validate(4)
    assert folder.objective_change(BASE.replace(resume=str(snap)), {"step": 2}) is None


def test_snapshot_holds_the_reference_state(saved, tmp_path):
    """Read with PyTorch's own DCP converter, each save layout's snapshot holds the
    independent reference's parameters, Adam moments and step counts after step 2, and
    the manifest lists each rank's file with its size."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for name, (cfg, full, part, snap) in saved.items():
        dcp_to_torch_save(str(snap), str(tmp_path / f"{name}.pt"))
        got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        want = _oracle_after(cfg, 2)
        tensors = {k for k in got if not k.startswith("rng/")}
        assert tensors == set(want), set(want) ^ tensors
        for k, v in want.items():
            tol = 1e-5 * max(1.0, v.abs().max().item()) if "exp_avg_sq" not in k else \
                1e-5 * v.abs().max().item() + 1e-12
            assert got[k].shape == v.shape, k
            assert (got[k] - v).abs().max().item() <= tol, (name, k)
        assert sum(k.startswith("rng/") for k in got) == cfg.parallel.world_size
        info = folder.read_info(snap)
        assert info["step"] == 2 and info["model"]["name"] == cfg.model_config.name
        sizes = {f.name: f.stat().st_size for f in snap.glob("*.distcp")}
        assert info["files"] == sizes
        mine = [m["snapshot"]["saved"][0] for m in part.metrics]
        assert sum(m["bytes_written"] for m in mine) == sum(sizes.values())


def test_save_every_and_write_then_rename(cluster4, tmp_path):
    """``save_every=1`` writes a snapshot per step, each complete; a folder left half
    written (``.partial-…``) is never taken for the latest; resuming takes the latest."""
    cfg = BASE.replace(parallel=dict(dp=2), steps=3, save_every=1, save_dir=str(tmp_path),
                       return_state=False)
    r = cluster4.run(jobs.train, cfg)
    assert [s["step"] for s in r.metrics[0]["snapshot"]["saved"]] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000001", "step_000002", "step_000003"]
    shutil.copytree(tmp_path / "step_000003", tmp_path / ".partial-step_000009")
    (tmp_path / ".partial-step_000009" / folder.MANIFEST).unlink()
    assert folder.latest(tmp_path).name == "step_000003"
    resumed = cluster4.run(jobs.train, cfg.replace(steps=4, save_every=0, resume=True))
    assert resumed.metrics[0]["snapshot"]["loaded"]["step"] == 3
    assert folder.latest(tmp_path).name == "step_000004"


# -- bad input: refused before launch, naming the file and the field ---------------------
def _copy(snap, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(snap.parent, d)
    return d, d / snap.name


def test_bad_snapshots_are_refused_before_launch(cluster4, saved, tmp_path):
    cfg, _, _, snap = saved["dp4"]
    d, s = _copy(snap, tmp_path)
    ok = BASE.replace(parallel=dict(dp=2), resume=str(s), return_state=False)
    ok.validate(4)
    # another model: names labkit.json and the field, with both values
    other = ok.replace(model=ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=16,
                                         name="snap-tiny"))
    with pytest.raises(ValueError, match=r"labkit\.json: model\.d_model=32 in the checkpoint "
                                         r"but 64 in this run"):
        cluster4.run(jobs.train, other)
    with pytest.raises(ValueError, match=r"labkit\.json: seed=0 in the checkpoint but 3"):
        cluster4.run(jobs.train, ok.replace(seed=3))
    # a truncated shard, then a missing one: the file and the sizes
    f = s / "__2_0.distcp"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 10)
    with pytest.raises(ValueError, match=rf"__2_0\.distcp: truncated shard: {size - 10} bytes, "
                                         rf"labkit\.json says {size}"):
        cluster4.run(jobs.train, ok)
    f.unlink()
    with pytest.raises(ValueError, match=r"__2_0\.distcp: shard file missing"):
        cluster4.run(jobs.train, ok)
    # a folder another live run is writing (its lock names a live pid: our parent)
    d2, s2 = _copy(snap, tmp_path / "b")
    lock = d2 / folder.LOCK
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                "step": 4, "t": 0}))
    with pytest.raises(ValueError, match=r"being written by another run \(.*\.in-progress: "
                                         rf"pid {os.getppid()}"):
        cluster4.run(jobs.train, ok.replace(resume=True, save_dir=str(d2)))
    # … only one being written: nothing to resume from
    shutil.move(str(s2), str(d2 / ".partial-step_000002"))
    with pytest.raises(ValueError, match="no complete snapshot.*being written"):
        cluster4.run(jobs.train, ok.replace(resume=str(d2)))
    # a stale lock (its process is gone) does not block
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "step": 4}))
    folder.check_lock(d2)
    # nothing to train, and fields without their partner
    with pytest.raises(ValueError, match="nothing left to train"):
        ok.replace(steps=2).validate(4)
    with pytest.raises(ValueError, match="save_every=2 has no effect here"):
        BASE.replace(save_every=2).validate(4)
    with pytest.raises(ValueError, match="resume=True needs save_dir"):
        BASE.replace(resume=True).validate(4)


def test_cli_flags_set_the_snapshot_fields(saved):
    """``labkit run --save-dir D --save-every N --resume [PATH]`` set the three fields, and a
    bad snapshot is a usage error before any rank starts."""
    from labkit.cli import build_parser
    from labkit.cli.common import UsageError
    from labkit.cli.run import config_from_args, resolve

    p = build_parser()
    cfg = config_from_args(p.parse_args(["run", "--save-dir", "ck", "--save-every", "2",
                                         "--resume"]))
    assert (cfg.save_dir, cfg.save_every, cfg.resume) == ("ck", 2, True)
    snap = saved["dp4"][3]
    cfg = config_from_args(p.parse_args(["run", "--resume", str(snap), "--dp", "2"]))
    assert cfg.resume == str(snap) and cfg.save_dir is None
    with pytest.raises(UsageError, match=r"labkit\.json: model\.d_model=32 in the checkpoint "
                                         r"but 64 in this run"):
        resolve(p.parse_args(["run", "--resume", str(snap), "--dp", "2", "--steps", "4"]),
                check_machine=False)
