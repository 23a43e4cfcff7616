"""``python -m labkit`` (also what ``torchrun ... -m labkit run ...`` executes)."""
from __future__ import annotations

import sys

from labkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
