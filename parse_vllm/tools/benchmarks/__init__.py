"""PARSE benchmarks (run through scripts/bench_verify.py, scripts/bench_e2e.py, `make bench`).

verify -- the verification pass on the target inside vLLM: floor, one-pass PARSE,
          sequential, independent requests; e2e -- MT-Bench end to end against the target
          alone and vLLM's token-level speculation, with the accept-all / reject-all brackets.
Every figure comes from one run, side by side; results go to bench/results/.
"""
