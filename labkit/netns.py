"""Network namespaces for :mod:`labkit.nodes`: a process that holds one open
(:class:`_Holder`) and the call that moves a rank into it (:func:`enter`).

Linux's ``unshare(1)``/``nsenter(1)`` build them (no root where user namespaces are
enabled) and ``setns(2)`` joins them; see ``namespaces(7)``.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
from dataclasses import dataclass
from typing import Optional

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000



@dataclass(frozen=True)
class NodeSpec:
    """What a rank needs to join its node: the holder's pid and the node's address."""

    pid: int
    node: int
    address: str

class _Holder:
    """A process that holds a new network namespace while our pipe to it stays open: when
    this process closes it (or dies), ``read`` sees EOF, the holder exits, and the namespace
    goes with the last process inside it. ``owner``: join that holder's user namespace
    first (non-root), so every namespace of one network shares one owner."""

    def __init__(self, owner: "Optional[_Holder]"):
        import time

        if os.geteuid() == 0:  # root needs no user namespace (they may be disabled)
            argv = ["unshare", "--net", "sh", "-c", "read _"]
        elif owner is None:
            argv = ["unshare", "--user", "--map-root-user", "--net", "sh", "-c", "read _"]
        else:
            argv = ["nsenter", "-t", str(owner.pid), "-U", "--preserve-credentials",
                    "unshare", "--net", "sh", "-c", "read _"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        mine, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 5
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip()
                self.close()
                raise OSError(f"no emulated nodes: `{' '.join(argv[:4])}` failed "
                              f"({err.splitlines()[-1] if err else 'no message'}); user "
                              "namespaces may be disabled")
            try:
                # nsenter execs unshare, which execs sh: same pid throughout
                if os.readlink(f"/proc/{self.proc.pid}/ns/net") != mine:
                    return
            except OSError:
                pass
            time.sleep(0.005)
        self.close()
        raise OSError("no emulated nodes: a network namespace did not appear within 5 s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        p = self.proc
        try:
            p.stdin.close()
            p.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()
        if p.stderr:
            p.stderr.close()


def _setns(path: str, kind: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, kind) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def enter(spec: NodeSpec) -> None:
    """Move this (single-threaded) process into node ``spec.node``'s network namespace and
    point gloo at its ``eth0`` (``GLOO_SOCKET_IFNAME``; ``LABKIT_NODE`` says which node).

    Root enters the network namespace directly (keeping its host credentials); others
    enter the namespaces' user namespace first.

    Raises:
        OSError: the holder is gone, or the kernel refused.
    """
    ns = f"/proc/{spec.pid}/ns"
    try:
        _setns(f"{ns}/net", _CLONE_NEWNET)
    except OSError:
        _setns(f"{ns}/user", _CLONE_NEWUSER)  # must precede the net ns it owns
        _setns(f"{ns}/net", _CLONE_NEWNET)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = "eth0"
    os.environ["LABKIT_NODE"] = str(spec.node)
