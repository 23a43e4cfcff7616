"""Clusters the planner lays models out on: a GPU and a bandwidth hierarchy (claims C2, C3).

A :class:`ClusterSpec` is a GPU type and a list of :class:`Level` s, innermost first. Level
``i`` groups ``size`` GPUs (8 in a server behind NVLink; a rack, a pod, the whole cluster
behind the network) and gives each GPU ``bandwidth`` bytes/s **per direction** to the others
at that level, with ``oversubscription`` (a level whose uplinks carry 1/k of the traffic
its GPUs can inject has ``oversubscription = k``).

Presets (every number is sourced in its ``source`` string):

* ``h100-server`` — one 8×H100 SXM server (DGX/HGX H100): NVLink 4 at 900 GB/s per GPU
  both directions (450 per direction), the lecture's "900 GB/s between the 8 GPUs" (C2).
* ``llama3-24k`` — Meta's 24,576-GPU H100 cluster that trained Llama 3 405B (Dubey et al.
  2024, §3.3.1): 8 GPUs per server behind NVLink; 2 servers per rack on one top-of-rack
  switch; 192 racks (3,072 GPUs) per pod with full bisection; 8 pods joined by aggregation
  switches oversubscribed 1:7; RoCE at 400 Gb/s (50 GB/s) per GPU.
* ``cs336-cluster`` — the hierarchy of the CS336 lecture (Lecture 7): 8 GPUs per NVLink
  node, about 256 GPUs fully connected through switches, slower beyond (leaf–spine). The
  lecture gives no number for "slower"; we take Llama 3's 1:7.
* ``selene-a100`` — NVIDIA Selene as Narayanan et al. 2021 used it (§5): DGX A100 servers
  of 8×A100 80 GB with NVLink 3 / NVSwitch (600 GB/s per GPU both directions) and eight
  200 Gb/s HDR InfiniBand adapters per server (25 GB/s per GPU), a three-level fat tree
  without oversubscription; 3,072 GPUs used at most.
* ``a100-server`` — one DGX A100 server; ``a100-40gb-256`` — 32 DGX A100 (40 GB) servers.
* ``deepseek-h800-2048`` — DeepSeek-V3's 2,048 H800s (DeepSeek-AI 2024, §3.1): NVLink cut to
  400 GB/s per GPU both directions, InfiniBand at 50 GB/s per GPU.
* ``tpu-v4-pod``, ``tpu-v5p-pod`` and ``tpu-v5p-4096`` — Google TPU pods: no switch, a 3-D
  **torus** of chips each wired to its six neighbours by inter-chip interconnect (ICI)
  links, wrapping around each axis (claim C41). ``torus`` gives the axis lengths, the one
  level's ``bandwidth`` one ICI link's one-way rate; :mod:`labkit.plan.torus` places groups
  on it. Figures from Austin et al. 2025, "How to Scale Your Model" (the scaling book),
  Part 2 "How to Think About TPUs": v4p 2.75e14 bf16 FLOP/s, 32 GB HBM at 1.2e12 B/s, pod
  16×16×16, ICI 4.5e10 B/s one-way per link; v5p 4.59e14 FLOP/s, 96 GB at 2.8e12 B/s, pod
  16×20×28 (8,960 chips), ICI 9e10 B/s one-way per link; ~1 µs per ICI hop.

HBM bandwidth is the GPU's own level (3,352 GB/s on an H100 SXM, C2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = ["GPU", "Level", "ClusterSpec", "GPUS", "CLUSTERS", "cluster_preset", "GiB"]

GiB = 2 ** 30
T = 1e12
G = 1e9


@dataclass(frozen=True)
class GPU:
    """One accelerator.

    Attributes:
        name: e.g. ``"H100-SXM"``.
        peak_flops: dense bf16/fp16 tensor-core peak, FLOP/s (the MFU denominator).
        memory_bytes: HBM capacity in bytes (binary: 80 GiB).
        hbm_bandwidth: HBM bandwidth, bytes/s.
        matmul_efficiency: fraction of ``peak_flops`` the best large GEMM reaches
            (maximum achievable matmul FLOP/s, MAMF).
        source: datasheet and measurement the numbers come from.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    hbm_bandwidth: float
    matmul_efficiency: float
    source: str


@dataclass(frozen=True)
class Level:
    """One level of the network hierarchy.

    Attributes:
        name: ``"nvlink"``, ``"rack"``, ``"pod"``, ``"cluster"``, ...
        size: GPUs in one domain of this level (8 in a server); a multiple of the level
            inside it.
        bandwidth: bytes/s each GPU can send to another GPU of the domain, per direction.
        latency: seconds one ring step costs on this level (NCCL's per-hop latency).
        oversubscription: ``k`` when the level's uplinks carry ``1/k`` of what its GPUs
            can inject (1 = full bisection).
    """

    name: str
    size: int
    bandwidth: float
    latency: float
    oversubscription: float = 1.0


@dataclass(frozen=True)
class ClusterSpec:
    """A GPU type and its network hierarchy, innermost level first.

    Attributes:
        name: preset name.
        gpu: the :class:`GPU`.
        levels: innermost first; the last level's ``size`` is the number of GPUs.
        source: where the topology comes from.
        torus: axis lengths ``(X, Y, Z)`` of a torus network (X varies fastest in the rank
            number), empty for a switched hierarchy; its one level is the ICI link.
        host: chips per host of a torus (what ``gpus_per_node`` reports for it).
    """

    name: str
    gpu: GPU
    levels: tuple[Level, ...]
    source: str
    torus: tuple = ()
    host: int = 4

    def __post_init__(self):
        prev = 1
        for lv in self.levels:
            if lv.size < prev or lv.size % prev:
                raise ValueError(f"ClusterSpec {self.name!r}: level {lv.name!r} size "
                                 f"{lv.size} is not a multiple of the level inside it ({prev})")
            prev = lv.size
        if self.torus:
            n = 1
            for d in self.torus:
                n *= d
            if len(self.levels) != 1 or n != self.levels[0].size:
                raise ValueError(f"ClusterSpec {self.name!r}: a torus {self.torus} needs one "
                                 f"level of {n} chips, got {[lv.size for lv in self.levels]}")

    @property
    def n_gpus(self) -> int:
        return self.levels[-1].size

    @property
    def gpus_per_node(self) -> int:
        """GPUs behind the innermost (NVLink) level; a torus's chips per host."""
        return self.host if self.torus else self.levels[0].size

    def hierarchy(self) -> list[tuple[str, int, float]]:
        """``(level, GPUs in one domain, bytes/s per GPU per direction)`` from the GPU's own
        HBM outwards (claim C2: 3,352 GB/s inside an H100, 450 GB/s each way — 900 both
        ways — between the 8 GPUs of a server, 50 GB/s beyond); an oversubscribed level
        is listed at its worst case, every GPU sending across it."""
        out = [("hbm", 1, self.gpu.hbm_bandwidth)]
        return out + [(lv.name, lv.size, lv.bandwidth / lv.oversubscription)
                      for lv in self.levels]

    @property
    def total_memory_bytes(self) -> float:
        """HBM of every GPU together (claim C3: 24,576 × 80 GiB = 1.875 PiB)."""
        return self.n_gpus * self.gpu.memory_bytes


# NCCL's tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol): 8.4 µs base
# latency per collective; per ring step 3.4 µs over NVLink and 9.6 µs over the network.
NCCL_BASE_LATENCY = 8.4e-6
NVLINK_HOP_LATENCY = 3.4e-6
NET_HOP_LATENCY = 9.6e-6
#: the scaling book's ~1 µs per ICI hop
ICI_HOP_LATENCY = 1e-6

GPUS: dict[str, GPU] = {
    "H100-SXM": GPU(
        "H100-SXM", 989.4 * T, 80 * GiB, 3352 * G, 0.801,
        "NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s "
        "(3,352 GB/s in the lecture, C2); MAMF 792.1 TFLOP/s = 80.1 % (S. Bekman, "
        "ml-engineering, compute/accelerator, MAMF table, CUDA 12.1); an 8192³ bf16 matmul "
        "on an H200 ran at 0.80 of peak in labkit's own check (DESIGN §9)"),
    "A100-SXM-80GB": GPU(
        "A100-SXM-80GB", 312 * T, 80 * GiB, 2039 * G, 0.859,
        "NVIDIA A100 datasheet: 312 TFLOP/s bf16/fp16 dense, 80 GB HBM2e at 2,039 GB/s; "
        "MAMF 267.9 TFLOP/s = 85.9 % (S. Bekman, ml-engineering, MAMF table, CUDA 12.1)"),
    "H800-SXM": GPU(
        "H800-SXM", 989.4 * T, 80 * GiB, 3352 * G, 0.801,
        "NVIDIA H800 SXM: the H100 SXM's compute and memory (989.4 TFLOP/s bf16, 80 GB at "
        "3.35 TB/s) with NVLink cut to 400 GB/s per GPU both directions; MAMF taken as the "
        "H100's"),
    "A100-SXM-40GB": GPU(
        "A100-SXM-40GB", 312 * T, 40 * GiB, 1555 * G, 0.859,
        "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 40 GB HBM2 at 1,555 GB/s; MAMF as "
        "the 80 GB part's"),
    "TPU-v4p": GPU(
        "TPU-v4p", 2.75e14, 32e9, 1.2e12, 0.80,
        "Austin et al. 2025, How to Scale Your Model, Part 2 (TPU v4p: 2.75e14 bf16 FLOP/s, "
        "32 GB HBM at 1.2e12 B/s); matmul efficiency assumed 0.80, the lecture's ~80 % "
        "ceiling (claim C20) — no TPU MAMF is published"),
    "TPU-v5p": GPU(
        "TPU-v5p", 4.59e14, 95 * GiB, 2.8e12, 0.80,
        "Austin et al. 2025, How to Scale Your Model, Part 2 (TPU v5p: 4.59e14 bf16 FLOP/s, "
        "96 GB HBM at 2.8e12 B/s); 95 GiB allocatable (Google Cloud TPU v5p page); matmul "
        "efficiency assumed 0.80 (claim C20's ceiling)"),
}

_H100 = GPUS["H100-SXM"]
_A100 = GPUS["A100-SXM-80GB"]
_NVLINK4 = Level("nvlink", 8, 450 * G, NVLINK_HOP_LATENCY)
_NVLINK3 = Level("nvlink", 8, 300 * G, NVLINK_HOP_LATENCY)

CLUSTERS: dict[str, ClusterSpec] = {
    "h100-server": ClusterSpec(
        "h100-server", _H100, (_NVLINK4,),
        "one DGX/HGX H100: NVLink 4 through NVSwitch, 900 GB/s per GPU both directions "
        "(NVIDIA DGX H100 datasheet)"),
    "llama3-24k": ClusterSpec(
        "llama3-24k", _H100,
        (_NVLINK4,
         Level("rack", 16, 50 * G, NET_HOP_LATENCY),
         Level("pod", 3072, 50 * G, NET_HOP_LATENCY),
         Level("cluster", 24576, 50 * G, NET_HOP_LATENCY, oversubscription=7.0)),
        "Dubey et al. 2024 (The Llama 3 Herd of Models) §3.3.1: 24K H100 80 GB (700 W) on "
        "Grand Teton servers of 8 GPUs joined by NVLink; RoCE at 400 Gb/s between GPUs; "
        "16 GPUs per rack on one ToR switch; 192 racks = 3,072 GPUs per pod with full "
        "bisection; 8 pods through aggregation switches at 1:7 oversubscription"),
    "cs336-cluster": ClusterSpec(
        "cs336-cluster", _H100,
        (_NVLINK4,
         Level("switch", 256, 50 * G, NET_HOP_LATENCY),
         Level("spine", 16384, 50 * G, NET_HOP_LATENCY, oversubscription=7.0)),
        "CS336 (2025) Lecture 7: 8 GPUs per node on NVLink/NVSwitch; ~256 GPUs all-to-all "
        "through InfiniBand switches at ~1/8 of NVLink (400 Gb/s NDR = 50 GB/s per GPU); "
        "leaf–spine beyond, slower (1:7, the Llama 3 cluster's taper, for want of a number)"),
    "selene-a100": ClusterSpec(
        "selene-a100", _A100,
        (_NVLINK3,
         Level("fat-tree", 3072, 25 * G, NET_HOP_LATENCY)),
        "Narayanan et al. 2021 §5: Selene, DGX A100 nodes of 8×A100 80 GB on NVLink 3 and "
        "NVSwitch (600 GB/s per GPU both directions), eight 200 Gb/s HDR InfiniBand HCAs "
        "per node for application traffic, a three-level fat tree (leaf, spine, core)"),
    "a100-server": ClusterSpec(
        "a100-server", _A100, (_NVLINK3,),
        "one DGX A100: 8×A100 80 GB, NVLink 3 through NVSwitch, 600 GB/s per GPU both "
        "directions (NVIDIA DGX A100 datasheet)"),
}


def _torus(name: str, chip: str, dims: tuple, link: float, source: str) -> ClusterSpec:
    n = 1
    for d in dims:
        n *= d
    return ClusterSpec(name, GPUS[chip], (Level("ici", n, link, ICI_HOP_LATENCY),), source,
                       torus=tuple(dims))


_BOOK = ("Austin et al. 2025, How to Scale Your Model (the scaling book), Part 2: a 3-D torus "
         "with wraparound, each chip linked to its 6 neighbours")
CLUSTERS["a100-40gb-256"] = ClusterSpec(
    "a100-40gb-256", GPUS["A100-SXM-40GB"],
    (_NVLINK3, Level("fat-tree", 256, 25 * G, NET_HOP_LATENCY)),
    "32 DGX A100 (40 GB) servers as NVIDIA sells them: NVLink 3 / NVSwitch, eight 200 Gb/s "
    "HDR InfiniBand adapters per server (25 GB/s per GPU); OLMo 7B trained on A100 40 GB "
    "(Groeneveld et al. 2024), whose network this does not claim to model")
CLUSTERS["deepseek-h800-2048"] = ClusterSpec(
    "deepseek-h800-2048", GPUS["H800-SXM"],
    (Level("nvlink", 8, 200 * G, NVLINK_HOP_LATENCY),
     Level("fat-tree", 2048, 50 * G, NET_HOP_LATENCY)),
    "DeepSeek-AI 2024 (DeepSeek-V3 Technical Report) §3.1: 2,048 H800 GPUs, 8 per node on "
    "NVLink / NVSwitch, InfiniBand between nodes (50 GB/s per GPU, §3.2.2)")
CLUSTERS["tpu-v4-pod"] = _torus("tpu-v4-pod", "TPU-v4p", (16, 16, 16), 4.5e10,
                                _BOOK + "; TPU v4p pod 16×16×16, ICI 4.5e10 B/s one-way per link")
CLUSTERS["tpu-v5p-pod"] = _torus("tpu-v5p-pod", "TPU-v5p", (16, 20, 28), 9e10,
                                 _BOOK + "; TPU v5p pod 16×20×28 = 8,960 chips, ICI 9e10 B/s "
                                 "one-way per link")
CLUSTERS["tpu-v5p-4096"] = _torus("tpu-v5p-4096", "TPU-v5p", (16, 16, 16), 9e10,
                                  _BOOK + "; a 16×16×16 slice of a v5p pod (Google Cloud "
                                  "lists it among v5p's full-torus slice shapes)")
CLUSTERS["tpu-v5p-6144"] = _torus("tpu-v5p-6144", "TPU-v5p", (16, 16, 24), 9e10,
                                  _BOOK + "; v5p's largest slice, 16×16×24 = 6,144 chips, "
                                  "the size Gemma 2 27B trained on (Gemma Team 2024, Table 3)")


def cluster_preset(cluster: Union[str, ClusterSpec]) -> ClusterSpec:
    """The named :class:`ClusterSpec` (or ``cluster`` itself).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if isinstance(cluster, ClusterSpec):
        return cluster
    try:
        return CLUSTERS[str(cluster)]
    except KeyError:
        raise ValueError(f"unknown cluster {cluster!r}; known: "
                         f"{', '.join(sorted(CLUSTERS))}") from None
