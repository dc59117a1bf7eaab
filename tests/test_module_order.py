"""The order test modules reach the xdist workers (fixtures/module_order.py)."""

import json

from fixtures.module_order import add_up, heaviest_first, write


def test_heaviest_module_first_unknown_before_known_tests_kept_in_order():
    ids = ["tests/a.py::x", "tests/b.py::y", "tests/a.py::z", "tests/c.py::w", "tests/new.py::v", "tests/b.py::u"]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 30.0, "tests/c.py": 5.0}
    got = [ids[i] for i in heaviest_first(ids, seconds)]
    assert got == [
        "tests/new.py::v",  # not measured: first
        "tests/b.py::y",  # 30 s
        "tests/b.py::u",
        "tests/a.py::x",  # 5 s, seen before c
        "tests/a.py::z",
        "tests/c.py::w",
    ]


def test_seconds_add_up_per_module_a_partial_run_keeps_the_others_and_gone_ones_go(tmp_path):
    measured = add_up([("tests/a.py::x", 1.5), ("tests/a.py::x", 2.0), ("tests/b.py::y[1]", 0.5)])
    assert measured == {"tests/a.py": 3.5, "tests/b.py": 0.5}
    (tmp_path / "tests").mkdir()
    for m in ("a", "b", "c"):
        (tmp_path / "tests" / f"{m}.py").write_text("")
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"tests/b.py": 9.0, "tests/c.py": 4.0, "tests/removed.py": 7.0}))
    write(path, measured, tmp_path)
    assert json.loads(path.read_text()) == {"tests/a.py": 3.5, "tests/b.py": 0.5, "tests/c.py": 4.0}
