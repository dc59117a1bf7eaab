#!/usr/bin/env python3
"""Prepare parse-vllm's models: thin wrapper around ``parse_vllm.tools.prepare_models.main``.

Run from the repository root with the venv active:

    python scripts/prepare_models.py [--cache-dir DIR] [--only NAME ...] [--quiet]

Works without the package being installed: the repository root is put on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parse_vllm.tools.prepare_models import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
