#!/usr/bin/env python
"""Regenerate BENCHMARKS.md (+ bench/full/) from the last full benchmark run."""

import sys

from parse_vllm.tools.benchmarks.report import main

if __name__ == "__main__":
    sys.exit(main())
