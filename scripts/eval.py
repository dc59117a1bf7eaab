#!/usr/bin/env python
"""Speed against quality: the target alone, token-level speculation and PARSE over a τ sweep, with a
recommendation (= `parse-vllm eval`; see parse_vllm/tools/eval/run.py and `--help`)."""

import sys

if __name__ == "__main__":
    from parse_vllm.tools.eval.run import main

    sys.exit(main())
