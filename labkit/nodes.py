"""Emulated nodes: a private network namespace whose node-to-node links are slower than
the links inside a node, built from the operating system's own tools.

On a real cluster the hierarchy decides the layout: 900 GB/s of NVLink between the 8 GPUs
of a server, 50 GB/s of InfiniBand per GPU between servers (an 18:1 ratio; the lectures'
claim C2). Over one loopback every pair of ranks talks at one speed, so a measured run
cannot tell "inside a server" from "across". :class:`EmulatedNetwork` makes the hierarchy
real on one machine:

* **a private network namespace per node** (``unshare --user --map-root-user --net``: no
  root needed where user namespaces are enabled; root skips the user namespace), each
  held by one small process that exits when its creator does, so nothing on the host
  changes and nothing outlives the cluster. Ranks of one node talk over their node's own
  loopback, unshaped (the "NVLink");
* **one address per node**, ``10.27.0.<node+1>`` on the node's ``eth0``, one end of a
  ``veth`` cable whose other end is a port of a bridge in a switch namespace; gloo binds
  to ``eth0`` (``GLOO_SOCKET_IFNAME``), so a rank's sockets to other nodes leave from its
  node's address. (One shared namespace with per-node loopback addresses cannot work:
  gloo's connecting side does not bind, so the kernel picks 127.0.0.1 as its source and
  one direction of every pair escapes an address filter.)
* **Linux traffic control** on both ends of each cable: an ``htb`` root with one
  rate-limited class, so each node's adapter runs at ``inter_node`` in each direction (the
  "InfiniBand"). Latency is added with ``netem`` under that class only where the kernel has
  it (:attr:`EmulatedNetwork.netem`).

A rank joins with :func:`enter` before it imports torch; the kernel↔rank control channel
stays on the pipes :mod:`labkit.startup` made, which no namespace affects. Under
``torchrun``, ``python -m labkit.nodes exec --pid PID --node K -- torchrun ...`` starts
one launcher per emulated node (:func:`main`).

Where the machine cannot do this (no user namespaces, no ``tc``), :func:`probe` returns
the one-line reason and the cluster runs flat.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Optional, Union

from .netns import NodeSpec, _Holder, enter  # noqa: F401  (the ranks import labkit.nodes.enter)

__all__ = ["DEFAULT_INTER_NODE", "PLACEMENTS", "EmulatedNetwork", "NodeSpec", "node_address",
           "node_of", "parse_rate", "probe", "enter", "launch"]

#: default bandwidth of each node's link to the others: 500 Mbit/s = 62.5 MB/s, so that the
#: busbw of a pair inside a node over the one across is of the order of NVLink over
#: InfiniBand per GPU (900/50 = 18): gloo's loopback all-reduce moves ~0.4-1.5 GB/s on a
#: 2-core machine, loaded to idle (benchmarks/multinode.py prints this machine's ratio)
DEFAULT_INTER_NODE = "500mbit"
#: the cables' MTU: loopback's 64 KiB, so a node-to-node byte costs what a local one does
MTU = 65535
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def node_address(node: int) -> str:
    """Address of emulated node ``node`` (0-based) inside the private namespaces."""
    return f"10.27.0.{node + 1}"


#: how ranks are dealt to nodes: "block" (the mesh's documented order, tp innermost, stays
#: inside a node) or "cyclic" (round robin: the innermost axis crosses nodes, as if tp were
#: the outermost axis — the lectures' counter-example, claim C34)
PLACEMENTS = ("block", "cyclic")


def node_of(rank: int, world_size: int, nodes: int, placement: str = "block") -> int:
    """Node of ``rank``: ``"block"``, consecutive blocks of ``world_size // nodes`` ranks,
    so the innermost mesh axis (tp, :mod:`labkit.mesh`) stays inside a node; ``"cyclic"``,
    ``rank % nodes``."""
    if placement == "cyclic":
        return rank % nodes
    return rank // (world_size // nodes)


def parse_rate(rate: Union[str, float, int]) -> float:
    """Bytes per second of a link rate: a number (bytes/s) or tc's syntax (``"1gbit"``,
    ``"400mbit"``, ``"100mbps"`` = 100 MB/s).

    Raises:
        ValueError: an unparseable or non-positive rate (names it).
    """
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        v = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]+)\s*", str(rate))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"inter_node={rate!r}: give bytes/s as a number or a tc rate "
                             f"such as '1gbit', '400mbit', '100mbps' (MB/s)")
        v = float(m.group(1)) * _UNITS[m.group(2).lower()] / 8
    if not v > 0:
        raise ValueError(f"inter_node={rate!r} must be a positive rate")
    return v


def _run(argv: list, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=20)


_PROBE: dict = {}


def probe() -> Optional[str]:
    """``None`` when this machine can emulate nodes, else the one-line reason why not.

    Cached per process: it builds (and removes) a 2-node network."""
    if "reason" not in _PROBE:
        try:
            EmulatedNetwork(2).close()
            _PROBE["reason"] = None
        except OSError as exc:
            _PROBE["reason"] = str(exc)
    return _PROBE["reason"]


class EmulatedNetwork:
    """Private network namespaces: one per node, joined by a switch, with shaped links.

    Args:
        nodes: emulated nodes (≥ 2).
        inter_node: each node's network adapter, per direction: bytes/s or a tc rate
            (:func:`parse_rate`); default :data:`DEFAULT_INTER_NODE`.
        latency_ms: one-way delay added to node-to-node packets; needs ``netem``
            (:attr:`netem`); without it one line says so, :attr:`latency_ms` becomes
            ``None`` and the links are shaped in bandwidth only.

    Raises:
        OSError: the namespaces or the traffic control could not be set up (the message is
            the one-line reason: no user namespaces, no ``tc``, no ``veth``).
        ValueError: fewer than 2 nodes, or a bad rate.
    """

    def __init__(self, nodes: int, inter_node: Union[str, float] = DEFAULT_INTER_NODE,
                 latency_ms: Optional[float] = None):
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 2:
            raise ValueError(f"nodes={nodes!r}: an emulated network needs at least 2 nodes")
        if nodes > 250:
            raise ValueError(f"nodes={nodes}: at most 250 node addresses")
        self.nodes, self.rate = nodes, parse_rate(inter_node)
        self.latency_ms = latency_ms
        self.switch, self.members = None, []
        try:
            for tool in ("unshare", "nsenter", "tc", "ip"):
                if shutil.which(tool) is None:
                    raise OSError(f"no emulated nodes: `{tool}` is not installed")
            self.switch = _Holder(None)
            self.ns(self.switch, "ip", "link", "set", "lo", "up")
            self.ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self.ns(self.switch, "ip", "link", "set", "br0", "up")
            if latency_ms and not self.netem:
                print(f"labkit: latency_ms={latency_ms} not emulated: this kernel has no "
                      "netem qdisc; the links are shaped in bandwidth only")
                self.latency_ms = None
            for n in range(nodes):
                self._add_node(n)
        except BaseException:
            self.close()
            raise

    def _add_node(self, n: int) -> None:
        h = _Holder(self.switch)
        self.members.append(h)
        port = f"n{n}"
        # one cable: the node's eth0 in its namespace, its port on the switch's bridge
        self.ns(self.switch, "ip", "link", "add", port, "mtu", str(MTU), "type", "veth",
                "peer", "name", "eth0", "mtu", str(MTU), "netns", str(h.pid))
        self.ns(self.switch, "ip", "link", "set", port, "master", "br0", "up")
        self.ns(h, "ip", "link", "set", "lo", "up")
        self.ns(h, "ip", "addr", "add", f"{node_address(n)}/24", "dev", "eth0")
        self.ns(h, "ip", "link", "set", "eth0", "up")
        self._shape(h, "eth0")          # the node's sends
        self._shape(self.switch, port)  # what the switch delivers to the node

    def _shape(self, h: "_Holder", dev: str) -> None:
        bits = int(self.rate * 8)
        self.ns(h, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default",
                "1")
        # the bucket holds one 64 KiB segment and a little (htb undershoots its rate when
        # a segment does not fit) and no more: a link stores no credit, and 256 KiB let a
        # 1 MiB all-reduce after 20 ms of compute cross at 1.26x the rate
        self.ns(h, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                "rate", f"{bits}bit", "burst", "80k", "cburst", "80k", "quantum", "65536")
        if self.latency_ms:
            self.ns(h, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "netem", "delay",
                    f"{self.latency_ms}ms")

    # -- commands inside a namespace ----------------------------------------------------
    @staticmethod
    def ns(h: "_Holder", *argv: str) -> str:
        """Run a command in ``h``'s network namespace; its stdout. ``OSError`` names it."""
        pre = ["nsenter", "-t", str(h.pid), "-n"]
        if os.geteuid() != 0:
            pre[3:3] = ["-U", "--preserve-credentials"]
        try:
            r = _run(pre + list(argv), check=False)
        except subprocess.TimeoutExpired:
            raise OSError(f"no emulated nodes: `{' '.join(argv)}` took over 20 s") from None
        if r.returncode:
            msg = (r.stderr.strip().splitlines() or ["exit code %d" % r.returncode])[-1]
            raise OSError(f"no emulated nodes: `{' '.join(argv)}` failed: {msg}")
        return r.stdout

    @property
    def netem(self) -> bool:
        """Whether the kernel offers ``netem`` (latency) here."""
        if "netem" not in _PROBE:
            try:
                self.ns(self.switch, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                        "delay", "1ms")
                self.ns(self.switch, "tc", "qdisc", "del", "dev", "lo", "root")
                _PROBE["netem"] = True
            except OSError:
                _PROBE["netem"] = False
        return _PROBE["netem"]

    # -- what ranks and callers use -------------------------------------------------------
    def spec(self, node: int) -> NodeSpec:
        return NodeSpec(self.members[node].pid, node, node_address(node))

    def link_bytes(self) -> dict:
        """Bytes each node has sent to the other nodes so far (its eth0's tc counter,
        Ethernet and IP headers included): ``{node: bytes}``."""
        out = {}
        for n, h in enumerate(self.members):
            m = re.search(r"Sent (\d+) bytes", self.ns(h, "tc", "-s", "class", "show", "dev",
                                                         "eth0", "classid", "1:1"))
            out[n] = int(m.group(1)) if m else 0
        return out

    @property
    def alive(self) -> bool:
        return self.switch is not None and all(h.alive for h in [self.switch, *self.members])

    def close(self) -> None:
        """Let the holders exit (each namespace goes with the last process inside it)."""
        for h in [*self.members, self.switch]:
            if h is not None:
                h.close()
        self.switch, self.members = None, []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def describe(self) -> str:
        lat = f", +{self.latency_ms} ms" if self.latency_ms else ""
        return (f"{self.nodes} nodes ({node_address(0)} … {node_address(self.nodes - 1)}), "
                f"each node's link {self.rate * 8 / 1e6:,.0f} Mbit/s = "
                f"{self.rate / 1e6:,.1f} MB/s per direction{lat}")


def launch(nodes: int, nproc_per_node: int, args: list, inter_node=DEFAULT_INTER_NODE,
           latency_ms: Optional[float] = None, port: int = 29500,
           timeout_s: Optional[float] = None) -> tuple:
    """Run ``torchrun --nnodes nodes … args`` with one launcher per emulated node.

    Each launcher lives in its node's namespace (:func:`enter`); they meet at node 0's
    address (torchrun's static rendezvous: ``--master-addr 10.27.0.1``). ``port`` is free
    by construction: the namespaces are private.

    Returns ``(results, link_bytes)``: one ``subprocess.CompletedProcess`` per node (text
    stdout/stderr), and the bytes each node's link carried (:meth:`EmulatedNetwork.link_bytes`).

    Raises:
        OSError: the network could not be built (the one-line reason).
        subprocess.TimeoutExpired: past ``timeout_s`` (every launcher is killed first).
    """
    net = EmulatedNetwork(nodes, inter_node, latency_ms)
    procs = []
    try:
        for k in range(nodes):
            argv = [sys.executable, "-m", "labkit.nodes", "exec", "--pid",
                    str(net.spec(k).pid), "--node", str(k), "--", sys.executable, "-m",
                    "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(k),
                    "--nproc-per-node", str(nproc_per_node), "--master-addr",
                    node_address(0), "--master-port", str(port), *args]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        out = []
        for p in procs:
            o, e = p.communicate(timeout=timeout_s)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
        return out, net.link_bytes()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        net.close()


def main(argv: Optional[list] = None) -> int:
    """``python -m labkit.nodes exec --pid PID --node K -- CMD …`` runs CMD as node K of
    the network whose node K is held by PID; ``python -m labkit.nodes launch --nodes N
    --nproc-per-node M [--inter-node RATE] -- TORCHRUN-ARGS …`` builds a network of N
    nodes and runs one torchrun launcher in each (exit code: the first non-zero)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m labkit.nodes")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exec", help="run a command inside emulated node K")
    e.add_argument("--pid", type=int, required=True, help="the node's holder pid")
    e.add_argument("--node", type=int, required=True)
    e.add_argument("command", nargs=argparse.REMAINDER)
    la = sub.add_parser("launch", help="torchrun --nnodes N, one launcher per emulated node")
    la.add_argument("--nodes", type=int, default=2)
    la.add_argument("--nproc-per-node", type=int, default=1)
    la.add_argument("--inter-node", default=DEFAULT_INTER_NODE, help="tc rate, e.g. 1gbit")
    la.add_argument("--latency-ms", type=float, default=None)
    la.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error(f"{a.cmd} needs a command after --")
    if a.cmd == "launch":
        try:
            res, _ = launch(a.nodes, a.nproc_per_node, cmd, a.inter_node, a.latency_ms)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rc = next((r.returncode for r in res if r.returncode), 0)
        for k, r in enumerate(res):
            sys.stdout.write(r.stdout)
            if rc:  # torchrun's own chatter (an agent's exit barrier …) only on failure
                sys.stderr.write("".join(f"[node {k}] {line}\n"
                                         for line in r.stderr.splitlines()))
        return rc
    enter(NodeSpec(a.pid, a.node, node_address(a.node)))
    os.execvp(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
