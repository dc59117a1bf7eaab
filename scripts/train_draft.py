#!/usr/bin/env python
"""Reproduce the shipped draft: `python scripts/train_draft.py --ship` (= `parse-vllm train-draft --ship`).

Resumable: re-running continues the answer generation and the distillation where they
stopped (work folder <cache>/train/<target>). See parse_vllm/tools/train_draft.py."""

import sys

from parse_vllm.tools.train_draft import main

if __name__ == "__main__":
    sys.exit(main())
