"""What every ``labkit`` sub-command shares: the usage error and the torchrun test.

Imports nothing beyond the standard library, so every module of the package may use it
without a cycle and before any validation.
"""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["UsageError", "Parser", "under_torchrun", "print_error"]


class UsageError(Exception):
    """Bad input: printed as one line ``error: ...``, exit code 2."""


def print_error(message: str) -> None:
    """``error: <message>`` on one line of stderr (runs of whitespace folded)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one ``error: ...`` line (exit code 2), like
    labkit's own checks, instead of the usage block followed by the message."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        print_error(f"{message} (see: {self.prog} --help)")
        raise SystemExit(2)


def under_torchrun(env=os.environ) -> bool:
    """True inside a worker started by torchrun / torch.distributed.run."""
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)
