"""Jobs for tests/test_nodes.py (emulated nodes). Importable by the ranks."""
from __future__ import annotations

import os
import socket
import struct

import torch
import torch.distributed as dist


def _ip(hex_addr: str) -> str:
    """``"0100007F:1F90"`` (little-endian hex, port) -> ``"127.0.0.1"``."""
    return socket.inet_ntoa(struct.pack("<I", int(hex_addr.split(":")[0], 16)))


def _tcp_established() -> list:
    """``(local ip, remote ip)`` of every established IPv4 TCP socket in this rank's
    network namespace (the kernel's own table, /proc/net/tcp)."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[3] != "01":  # TCP_ESTABLISHED
                continue
            out.append((_ip(cols[1]), _ip(cols[2])))
    return out


def node_facts(ctx, cfg=None) -> dict:
    """After one all-reduce over every rank: this rank's node, network namespace, and the
    addresses of gloo's connections."""
    x = torch.ones(4) * ctx.rank
    dist.all_reduce(x, group=ctx.group)
    return {"node": os.environ.get("LABKIT_NODE"), "netns": os.readlink("/proc/self/ns/net"),
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "sum": x.tolist(),
            "tcp": _tcp_established()}


def send(ctx, cfg: tuple) -> None:
    """``cfg = (src, dst, nbytes)``: rank src sends nbytes to rank dst; the rest idle."""
    src, dst, nbytes = cfg
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if ctx.rank == src:
        buf.fill_(7)
        dist.send(buf, dst, group=ctx.group)
    elif ctx.rank == dst:
        dist.recv(buf, src, group=ctx.group)
        assert int(buf.min()) == int(buf.max()) == 7
