"""Answer checkers (the ``check`` of a prompt-set item, :mod:`parse_vllm.tools.eval.tasks`).

Answers are never run in this process: code goes to ``python -I`` in a subprocess, in an
empty temporary folder, with a wall-clock timeout (then its whole process group is killed),
CPU, memory and file-size limits, and nothing on its command line or in its environment
but the file to run.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
import unicodedata
from typing import Any

CODE_TIMEOUT_S = 10.0
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def normalize(text: str) -> str:
    """Lower case, accents and punctuation dropped, spaces collapsed."""
    text = unicodedata.normalize("NFKD", str(text))
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[^\w\s.-]", " ", text)
    text = re.sub(r"(?<!\d)[.-]|[.-](?!\d)", " ", text)  # keep 3.5 and -4, drop sentence dots and dashes
    return " ".join(text.split())


def _contains(hay: str, needle: str) -> bool:
    return bool(needle) and re.search(rf"(?<![\w.]){re.escape(needle)}(?![\w]|\.\d)", hay) is not None


def check_answer(text: str, answer: str, distractors: list[str] | tuple = ()) -> bool:
    """The reply is the answer, or contains it (whole words) and none of the distractors."""
    got, want = normalize(text), normalize(answer)
    if got == want:
        return True
    return _contains(got, want) and not any(_contains(got, normalize(d)) for d in distractors if normalize(d) != want)


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def check_number(text: str, answer: float) -> bool:
    got = last_number(text)
    return got is not None and abs(got - float(answer)) <= 1e-9 * max(1.0, abs(float(answer)))


def last_list(text: str) -> list | None:
    """The last ``[...]`` in the reply that reads as a Python/JSON literal list; else, the
    numbers of the reply's last non-empty line (a bare "2, 1, 3")."""
    for m in reversed(list(re.finditer(r"\[[^\[\]]*\]", text))):
        try:
            value = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, list):
            return value
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if lines:
        nums = _NUMBER.findall(lines[-1])
        if nums:
            return [float(n.replace(",", "")) for n in nums]
    return None


def check_list(text: str, answer: list) -> bool:
    got = last_list(text)
    return (
        got is not None
        and len(got) == len(answer)
        and all(
            g == a or (isinstance(g, (int, float)) and isinstance(a, (int, float)) and float(g) == float(a))
            for g, a in zip(got, answer)
        )
    )


def extract_code(text: str) -> str:
    """The first fenced Python block that defines something (else the first fenced block;
    a block cut short by the token limit counts), or the whole reply when there is none."""
    blocks = _FENCE.findall(text)
    for b in blocks:
        if re.search(r"^\s*(def|class)\s", b, re.M):
            return b
    return blocks[0] if blocks else text


def _limits(timeout: float):
    def apply() -> None:
        import resource

        cpu = int(timeout) + 1
        for res, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (1 << 30, 1 << 30)),
            (resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            try:
                resource.setrlimit(res, value)
            except (ValueError, OSError):
                pass

    return apply


def run_code(code: str, test: str, timeout: float = CODE_TIMEOUT_S) -> tuple[bool, str]:
    """Run ``code`` then ``test`` in ``python -I`` in a fresh temporary folder. Passed when it
    exits 0 within ``timeout`` seconds; (passed, why not)."""
    with tempfile.TemporaryDirectory(prefix="parse-vllm-check-") as tmp:
        path = os.path.join(tmp, "answer.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code.rstrip() + "\n\n# -- test --\n" + test.rstrip() + "\n")
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", path],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_limits(timeout) if os.name == "posix" else None,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return False, f"timed out after {timeout:g} s"
        if proc.returncode == 0:
            return True, ""
        lines = err.decode("utf-8", "replace").strip().splitlines()
        return False, lines[-1] if lines else f"exit status {proc.returncode}"


def check(text: str, spec: dict[str, Any] | None, *, timeout: float = CODE_TIMEOUT_S) -> bool | None:
    """True/False for a checkable item, None when ``spec`` is None (not checkable)."""
    if not spec:
        return None
    kind = spec["type"]
    if kind == "answer":
        return check_answer(text, spec["answer"], spec.get("distractors", ()))
    if kind == "number":
        return check_number(text, spec["answer"])
    if kind == "list":
        return check_list(text, spec["answer"])
    if kind == "code":
        return run_code(spec.get("prelude", "") + extract_code(text), spec["test"], timeout)[0]
    if kind == "all":
        return all(check(text, s, timeout=timeout) for s in spec["checks"])
    raise ValueError(f"unknown check type {kind!r}")
