#!/usr/bin/env python
"""The verification pass on the target inside vLLM: floor, PARSE one pass, sequential,
independent requests (see parse_vllm/tools/benchmarks/verify.py). `--quick` for make bench."""

import sys

if __name__ == "__main__":
    from parse_vllm.tools.benchmarks.verify import main

    sys.exit(main())
