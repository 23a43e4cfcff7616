"""Distributed snapshots of the whole training state, resharded on load.

Not to be confused with *activation* checkpointing (``RunConfig.checkpoint``,
:mod:`labkit.parallel.checkpoint`), which recomputes activations inside one step. A
snapshot is the training run's state on disk — parameters and AdamW state in their shards,
the step (which is also the data position: every batch is a pure function of seed and
step), each rank's RNG — written by every rank in parallel with
``torch.distributed.checkpoint`` and loadable into any other valid layout of the same model.

* :mod:`.pieces` — a rank's shards as boxes at global offsets (DCP's checkpointable
  protocol); DCP's planners reshard by overlap.
* :mod:`.state` — which boxes a composition holds (plain, tensor-parallel, expert, ZeRO
  flat-unit, FSDP2), and AdamW's state beside them.
* :mod:`.folder` — the save folder: write to ``.partial-step_N``, rename when complete,
  a lock for the writer, and the checks made before a run resumes.
* :mod:`.io` — :func:`save` and :func:`load` on the ranks, with bytes, seconds and files.

``RunConfig(save_dir=..., save_every=k)`` saves after every ``k`` steps and after the last;
``RunConfig(resume=True)`` continues from the latest complete snapshot in ``save_dir``.
"""
__all__ = ["save", "load"]


def __getattr__(name):
    # lazily: validation imports .folder before launch, without torch
    if name in ("save", "load"):
        from . import io

        return getattr(io, name)
    raise AttributeError(name)
