"""One rank's complete training state as global-offset pieces, saved and loaded with
``torch.distributed.checkpoint``.

The state of a composition is, per parameter of the *full* model (its full name and shape):
the fp32 parameter and AdamW's two moments, wherever this rank holds them —

* a plain parameter of a stage (no ZeRO; a tied copy or the experts under ZeRO): the whole
  tensor, or its tensor-parallel slice (offset ``tp_index · local`` along the split dim,
  vocabulary padding cut off), or its block of experts (offset ``ep_index · E/ep``);
* a ZeRO-1/2/3 flat unit's fp32 master shard ``[lo, hi)``: the boxes of each parameter that
  range covers (:func:`~labkit.snapshot.pieces.range_boxes`), then the tensor-parallel offset;
* a FSDP2 ``DTensor``: its ``Shard(0)`` chunk;

plus AdamW's step count per parameter, the step, and each rank's RNG state. Every rank
writes only its own boxes (DCP deduplicates replicas), and a rank of *any* other layout
asks DCP for its own boxes: DCP reads the overlap of each saved chunk ("load-time
resharding", PyTorch's torch.distributed.checkpoint documentation). Because every box is a
view of the rank's storage, loading is in place (as DCP requires): no full tensor is ever
built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..parallel.dp import unique_parameters
from .pieces import Pieces, range_boxes

__all__ = ["Slot", "slots", "state_dict", "init_optimizer_state", "after_load", "rng_key",
           "reads"]


@dataclass
class Slot:
    """A box of one full-model parameter held by this rank.

    ``param`` is the optimizer's tensor holding it (a parameter, a ZeRO master shard, a
    DTensor); the box is the flat elements ``[start, start + prod(sizes))`` of its local
    storage, viewed as ``sizes``, sitting at ``offsets`` in the global tensor of ``shape``;
    ``keep`` (``{dim: n}``) cuts vocabulary padding off the end of the box."""

    fqn: str
    shape: tuple
    param: torch.Tensor
    start: int
    sizes: tuple
    offsets: tuple
    keep: dict

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The box in ``t`` (``param`` itself or an AdamW moment of it)."""
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        v = local.detach().view(-1)[self.start:self.start + math.prod(self.sizes)]
        v = v.view(self.sizes)
        for d, n in self.keep.items():
            v = v.narrow(d, 0, n)
        return v


def _mapping(setup, module, name: str, local_shape: tuple, is_expert: bool) -> tuple:
    """``(full name, global shape, shift per dim, limit per dim)`` of a stage's local
    parameter ``name`` of ``local_shape`` on this rank."""
    mg, mc = setup.mg, setup.cfg.model_config
    shape, shift, limit = list(local_shape), [0] * len(local_shape), {}
    fqn = getattr(module, "full_name", lambda n: n)(name)
    if is_expert and mg.size("ep") > 1:  # rank r keeps experts [r·E/ep, (r+1)·E/ep)
        shift[0] = mg.index("ep") * local_shape[0]
        shape[0] = local_shape[0] * mg.size("ep")
    info = getattr(module, "tp_info", None)
    if info is not None and name in info.shards:
        fqn, dim, size = info.shards[name]
        if dim is not None:
            shift[dim] += mg.index("tp") * local_shape[dim]
            shape[dim] = size
            limit[dim] = size
    if mc.kind == "gpt" and mc.tie_embeddings and fqn == "head.weight":
        fqn = "tok_emb.weight"  # one parameter under two names: saved once
    return fqn, tuple(shape), shift, limit


def _place(fqn, shape, shift, limit, param, base: tuple, local_shape, a: int, b: int,
           start0: int) -> list:
    """Slots for the flat range ``[a, b)`` of a local tensor of ``local_shape`` whose element
    0 is element ``start0`` of ``param``'s storage; ``base`` is its own offset in the global
    tensor (a DTensor chunk's)."""
    out = []
    for fs, off, sz in range_boxes(local_shape, a, b):
        g = [o + s + c for o, s, c in zip(off, shift, base)]
        keep = {}
        for d, lim in limit.items():
            if g[d] >= lim:
                break
            if g[d] + sz[d] > lim:
                keep[d] = lim - g[d]
        else:
            out.append(Slot(fqn, tuple(shape), param, start0 + fs, tuple(sz),
                            tuple(g), keep))
    return out


def slots(setup) -> list:
    """Every box of every parameter this rank holds (see the module docstring), each once."""
    out, seen = [], set()
    experts = {id(p) for p in setup.expert_params}
    for s in sorted(setup.stages):
        m = setup.stages[s]
        for w in setup.sharded:
            if w.module is not m:
                continue
            for u in w.units:
                for e in u.entries:
                    a, b = max(u.lo, e.offset), min(u.hi, e.offset + e.numel)
                    if a >= b:
                        continue
                    fqn, shape, shift, limit = _mapping(setup, m, e.name, tuple(e.shape), False)
                    # element x of the entry is element x + e.offset - lo of the master
                    out += _place(fqn, shape, shift, limit, u.master, (0,) * len(e.shape),
                                  tuple(e.shape), a - e.offset, b - e.offset, e.offset - u.lo)
        for name, p in unique_parameters(m):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if hasattr(p, "_local_tensor"):  # FSDP2: this rank's Shard(0) chunk
                chunk = p.__create_chunk_list__()[0]
                local_shape, base = tuple(chunk.sizes), tuple(chunk.offsets)
                _check_dim0_chunk(name, p, local_shape)
                glob_shape = tuple(p.shape)
            else:
                local_shape, base, glob_shape = tuple(p.shape), (0,) * p.dim(), tuple(p.shape)
            fqn, shape, shift, limit = _mapping(setup, m, name, glob_shape, id(p) in experts)
            out += _place(fqn, shape, shift, limit, p, base, local_shape, 0,
                          math.prod(local_shape), 0)
    uniq, keys = [], set()
    for sl in out:  # ZB-V's two local stages share the tied parameter: one box
        k = (sl.fqn, sl.offsets)
        if k not in keys:
            keys.add(k)
            uniq.append(sl)
    return uniq


def _check_dim0_chunk(name: str, p, chunk_shape: tuple) -> None:
    """A FSDP2 DTensor's box is the first ``prod(chunk_shape)`` elements of its local
    storage. FSDP2 splits dim 0 in chunks of ⌈d₀/K⌉ rows (``torch.chunk``: the last ranks
    get fewer rows, or none) and pads its all-gather buffer, not the parameter: the local
    tensor is the unpadded chunk. Should a local tensor carry the padding rows, they follow
    the real ones in dim 0, so the box is still its head; any other placement is refused.

    Raises:
        NotImplementedError: a placement other than ``Shard(0)`` over one mesh axis, or a
            local tensor that is not the chunk with (possibly) rows of padding after it.
    """
    from torch.distributed.tensor import Shard

    local = tuple(p._local_tensor.shape)
    placements = tuple(p.placements)
    if placements != (Shard(0),) or len(local) != len(chunk_shape) or \
            local[1:] != chunk_shape[1:] or local[:1] < chunk_shape[:1]:
        raise NotImplementedError(f"{name}: a DTensor with placements {placements} and local "
                                  f"shape {local} for the chunk {chunk_shape}: only FSDP2's "
                                  f"Shard(0) over one axis is snapshotted")


def rng_key(rank: int, world: int) -> str:
    return f"rng/{world}x{rank}"


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step would create it (zero moments, step 0), so a load
    has tensors to write into."""
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_dict(setup, sl: list, rank: int, world: int, for_load: bool) -> tuple:
    """``(dcp state dict, steps)``: ``model/…``, ``optim/exp_avg/…``, ``optim/exp_avg_sq/…``
    as :class:`Pieces`, ``optim/step/…`` 0-d tensors (fresh ones to read into when
    ``for_load``: ``steps`` maps each to its optimizer parameters), this rank's RNG state."""
    by: dict = {}
    for x in sl:
        by.setdefault(x.fqn, []).append(x)
    opt_state = setup.opt.state
    sd: dict = {}
    steps: dict = {}
    for fqn, xs in by.items():
        shape = xs[0].shape
        sd[f"model/{fqn}"] = Pieces(shape, [(x.offsets, x.view(x.param)) for x in xs])
        st = opt_state.get(xs[0].param) or {}
        if "exp_avg" not in st:
            continue
        for k in ("exp_avg", "exp_avg_sq"):
            sd[f"optim/{k}/{fqn}"] = Pieces(shape, [(x.offsets, x.view(opt_state[x.param][k]))
                                                   for x in xs])
        key = f"optim/step/{fqn}"
        sd[key] = torch.zeros((), dtype=torch.float32) if for_load else st["step"]
        steps[key] = {id(x.param): x.param for x in xs}
    gen = torch.get_rng_state()
    sd[rng_key(rank, world)] = torch.empty_like(gen) if for_load else gen
    return sd, steps


def after_load(setup, sd: dict, steps: dict, rank: int, world: int, same_layout: bool) -> None:
    """Finish a load: AdamW's step per optimizer parameter (one value for all the
    parameters a ZeRO master holds), the bf16 / replicated copies ZeRO keeps of the masters,
    and, in the same layout, this rank's RNG state."""
    per_param: dict = {}
    for key, params in steps.items():
        for pid, p in params.items():
            per_param.setdefault(pid, (p, set()))[1].add(float(sd[key]))
    for p, vals in per_param.values():
        if len(vals) != 1:
            raise ValueError(f"the parameters of one ZeRO shard have different AdamW step "
                             f"counts in the checkpoint: {sorted(vals)}")
        setup.opt.state[p]["step"].fill_(vals.pop())
    for w in setup.sharded:
        w.after_step()
    if same_layout:
        torch.set_rng_state(sd[rng_key(rank, world)])


def reads(planner, reader) -> dict:
    """What this rank read: ``{file: bytes}`` from the storage items its load plan named
    (each item is read whole; DCP narrows it to the box afterwards) and the bytes its boxes
    needed."""
    files: dict = {}
    seen = set()
    needed = 0
    for item in planner.read_plan.items:
        needed += math.prod(item.lengths) if item.lengths is not None else 0
        idx = item.storage_index
        key = (idx.fqn, tuple(idx.offset or ()))
        if key in seen:
            continue
        seen.add(key)
        info = reader.storage_data[idx]
        files[info.relative_path] = files.get(info.relative_path, 0) + info.length
    return {"files": files, "elements_needed": needed}

