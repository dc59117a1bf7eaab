"""`parse-vllm train-judge`: a judge head for PARSE's verification pass, trained on a
checkable prompt set (run.py), from data built in resumable stages (data.py), a logistic
probe with grouped cross-validation (probe.py) and a report (report.py)."""

from .run import main

__all__ = ["main"]
