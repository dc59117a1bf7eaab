#!/usr/bin/env python
"""End to end on MT-Bench: target alone, vLLM token-level (k=4), PARSE modes and a τ sweep,
with the accept-all / reject-all brackets (see parse_vllm/tools/benchmarks/e2e.py). `--quick` for make bench."""

import sys

if __name__ == "__main__":
    from parse_vllm.tools.benchmarks.e2e import main

    sys.exit(main())
