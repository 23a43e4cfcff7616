"""HSDP process groups: ``M`` replicas × ``K`` shards over one group (FSDP inside a replica
group of ``K`` ranks, data parallelism across the ``M`` replicas)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import comm

__all__ = ["hsdp_groups"]


def hsdp_groups(group, replicas: int, cache: Optional[dict] = None):
    """``(shard_group, replicate_group)`` of an ``M = replicas`` × ``K`` mesh over ``group``.

    Group ranks ``[g·K, (g+1)·K)`` form shard group ``g``; ranks with equal index inside
    their shard group form a replicate group. ``replicas == 1`` gives ``(group, None)``.
    Groups are cached in ``cache`` keyed by their rank tuples.

    When ``group`` spans the whole world, every rank creates every group in the same order
    (shard groups, then replicate groups), as ``new_group`` requires. On a job that uses
    only part of a cluster the idle ranks cannot join, so the groups are created with
    ``use_local_synchronization``; torch names those by the ranks *and* the number of
    groups each member already belongs to (``_hash_ranks_to_str``), so members must agree
    on that count — checked first, since a mismatch would hang.

    Raises:
        ValueError: ``replicas`` does not divide the group size.
        RuntimeError: a partial-cluster job whose ranks belong to different numbers of
            process groups (run HSDP on a cluster whose world size is the job's ranks).
    """
    ranks = comm.group_ranks(group)
    n = len(ranks)
    if replicas < 1 or n % replicas:
        raise ValueError(f"hsdp_replicas={replicas} does not divide the {n} ranks of the group")
    if replicas == 1:
        return group, None
    k = n // replicas
    g, i = divmod(ranks.index(dist.get_rank()), k)
    shards = [tuple(ranks[j * k:(j + 1) * k]) for j in range(replicas)]
    repls = [tuple(ranks[j::k]) for j in range(k)]
    cache = {} if cache is None else cache
    key = ("hsdp-groups", ranks, replicas)
    if key not in cache:
        if n == dist.get_world_size():
            made = {rs: dist.new_group(list(rs)) for rs in shards + repls}
        else:
            from torch.distributed import distributed_c10d as c10d
            mine = torch.tensor([float(len(c10d._world.pg_names))])
            seen = torch.empty(n)
            comm.all_gather(seen, mine, group=group)
            if len(set(seen.tolist())) > 1:
                raise RuntimeError(
                    f"HSDP on {n} of the cluster's {dist.get_world_size()} ranks: the job's "
                    f"ranks belong to different numbers of process groups "
                    f"({seen.int().tolist()}), so torch would give their local sub-groups "
                    f"different names and hang. Use a cluster with world_size={n}.")
            made = {rs: dist.new_group(list(rs), use_local_synchronization=True)
                    for rs in (shards[g], repls[i])}
        cache[key] = made
    made = cache[key]
    return made[shards[g]], made[repls[i]]
