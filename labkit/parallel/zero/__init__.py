"""ZeRO-1/2/3, FSDP and HSDP from labkit's traced collectives (claims C10–C16).

* :mod:`.flat` — flat units: a block's parameters packed into one padded, sharded buffer;
* :mod:`.sharded` — what every stage does with them (reduce-scatter, HSDP all-reduce, AdamW
  over the shards);
* :mod:`.stage12` — ZeRO-1 and ZeRO-2 (:class:`ZeroDataParallel`);
* :mod:`.fsdp` — ZeRO-3 / FSDP with prefetch (:class:`FullyShardedDataParallel`);
* :mod:`.hsdp` — the replica × shard groups of HSDP.
"""
from .flat import FlatUnit, build_units
from .fsdp import FullyShardedDataParallel
from .hsdp import hsdp_groups
from .sharded import ShardedDataParallel
from .stage12 import ZeroDataParallel

__all__ = ["FlatUnit", "build_units", "ShardedDataParallel", "ZeroDataParallel",
           "FullyShardedDataParallel", "hsdp_groups"]
