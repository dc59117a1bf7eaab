"""The record of kernel measurements (kernel_measurements.json beside this file): its
schema, the check of one entry, and how a GPU run writes its entry into it.

Standard library only: scripts/gpu_check.sh loads this file by path while vLLM is
blocked (importing parse_vllm.verify would import vLLM), right after the goal table
and again at the end of the run, so that a run whose later steps fail, or that is
cut short, still leaves its measurement in the repository's record, marked with
what failed. The verifier factory (factory.py) reads the same record with the same
check.
"""

from __future__ import annotations

import json
from pathlib import Path

MEASUREMENTS_SCHEMA = "parse-vllm/kernel-measurements/1"


def check_entry(e) -> dict:
    """One measurement of the record, checked (ValueError naming what is wrong)."""
    if not isinstance(e, dict):
        raise ValueError(f"a measurement must be an object, got {type(e).__name__}")
    for key in ("kernel_version", "device", "capability", "date", "dtype", "source"):
        if not isinstance(e.get(key), str) or not e[key]:
            raise ValueError(f"measurement {e.get('kernel_version')!r}: {key!r} must be a non-empty string")
    major, _, minor = e["capability"].partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"measurement {e['kernel_version']!r}: capability {e['capability']!r} is not 'X.Y'")
    if "failed" in e and not (isinstance(e["failed"], list) and all(isinstance(f, str) for f in e["failed"])):
        raise ValueError(f"measurement {e['kernel_version']!r}: 'failed' must be a list of step or shape names")
    rows = e.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"measurement {e['kernel_version']!r}: 'rows' must be a non-empty list")
    for r in rows:
        where = f"measurement {e['kernel_version']!r}, row {r!r}"
        if not isinstance(r, dict) or not all(
            isinstance(r.get(k), int) and r[k] > 0 for k in ("ctx", "K", "Hq", "Hkv")
        ):
            raise ValueError(f"{where}: ctx, K, Hq, Hkv must be positive integers")
        if "D" in r and not (isinstance(r["D"], int) and r["D"] > 0):
            raise ValueError(f"{where}: D must be a positive integer")
        baselines = [r.get(k) for k in ("per_copy_us", "forked_us") if k in r]
        if not baselines or not all(isinstance(b, dict) and b for b in baselines):
            raise ValueError(
                f"{where}: forked_us and / or per_copy_us (baseline name -> us, at least one) must be given"
            )
        times = [r.get("op_us")] + [t for b in baselines for t in b.values()]
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in times):
            raise ValueError(f"{where}: op_us and every baseline's us must be positive numbers")
    return e


def _same_run(a: dict, b: dict) -> bool:
    """One kernel, one GPU, one dtype, the same head sizes: a later run replaces it."""
    heads = lambda e: sorted({r.get("D") for r in e["rows"]}, key=str)  # noqa: E731
    return all(a[k] == b[k] for k in ("kernel_version", "device", "dtype")) and heads(a) == heads(b)


def write_measurement(path: str | Path, entry: dict, failed_steps: list[str] = ()) -> str:
    """Write `entry` (bench_kernel.kernel_measurement's) into the record at `path`, replacing
    an entry of the same kernel, GPU, dtype and head sizes, else appended; the steps of the
    run that failed join the entry's `failed` list (with the shapes that failed), and
    `complete` stays as the benchmark set it. Returns what was done, in one line."""
    path = Path(path)
    entry = dict(entry)
    failed = list(dict.fromkeys([*entry.get("failed", []), *failed_steps]))
    if failed:
        entry["failed"] = failed
    check_entry(entry)
    doc = json.loads(path.read_text())
    if doc.get("schema") != MEASUREMENTS_SCHEMA or not isinstance(doc.get("measurements"), list):
        raise ValueError(f"{path}: not a {MEASUREMENTS_SCHEMA} record")
    kept = [e for e in doc["measurements"] if not _same_run(e, entry)]
    replaced = len(kept) != len(doc["measurements"])
    doc["measurements"] = kept + [entry]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    what = "replaced the entry of" if replaced else "added an entry for"
    return (
        f"{path}: {what} kernel {entry['kernel_version']} on {entry['device']} ({len(entry['rows'])} rows"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + ("" if entry.get("complete", True) else "; incomplete")
        + ")"
    )
