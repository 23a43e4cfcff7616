"""``torchrun`` across emulated nodes: :func:`launch` starts one launcher per node of an
:class:`labkit.nodes.EmulatedNetwork`, and :func:`main` is the command line behind
``python -m labkit.nodes exec|launch``.

:mod:`labkit.nodes` builds the network and hands these two names out on first use (it
cannot import this module at its top: this module imports it).
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from .nodes import DEFAULT_INTER_NODE, EmulatedNetwork, NodeSpec, enter, node_address

__all__ = ["launch", "main"]


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
