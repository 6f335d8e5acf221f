"""The order the suite's items are handed to pytest-xdist's workers (tests/worker_order.py)."""

from types import SimpleNamespace

from worker_order import UNLISTED_SECONDS, balanced_order, expected_seconds, share_sizes


def test_xdist_cuts_the_items_into_shares_as_its_worksteal_scheduler_does():
    assert share_sizes(25, 2) == [12, 13]
    assert share_sizes(9, 3) == [3, 3, 3]
    assert share_sizes(1, 2) == [0, 1]


def test_each_worker_gets_an_even_share_of_the_seconds_and_a_files_items_stay_together():
    """In collection order the first worker's share holds the four long files (an SPMD file
    is one item) and the second's only the short tests; dealt, each worker starts on long
    files, and the two shares differ by less than the short files' seconds."""
    seconds = {"spmd/a.py::run": 300, "spmd/b.py::run": 250, "spmd/c.py::run": 200, "spmd/d.py::run": 150}
    seconds |= {f"test_e.py::case{i}": 5 for i in range(6)} | {f"test_f.py::case{i}": 2 for i in range(6)}
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in seconds]
    order = balanced_order(items, seconds, workers=2)
    assert sorted(item.nodeid for item in order) == sorted(seconds)
    shares = order[:8], order[8:]
    loads = [sum(seconds[item.nodeid] for item in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= 30, loads
    for share in shares:
        assert share[0].nodeid.startswith("spmd/")
        files = [item.nodeid.split("::")[0] for item in share]
        runs = [file for index, file in enumerate(files) if index == 0 or files[index - 1] != file]
        assert len(runs) == len(set(runs)), files  # each file's items in one run


def test_an_item_no_run_has_timed_counts_as_a_short_one(tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text('{"quick": {"test_a.py::x": 3.0}, "full": {"test_a.py::x": 7.0, "test_b.py::y": 1.5}}')
    assert expected_seconds("quick", durations) == {"test_a.py::x": 3.0}
    assert expected_seconds("all", durations) == {"test_a.py::x": 10.0, "test_b.py::y": 1.5}
    assert expected_seconds("quick", tmp_path / "missing.json") == {}
    items = [SimpleNamespace(nodeid=n) for n in ("test_new.py::x", "test_a.py::x")]
    assert [i.nodeid for i in balanced_order(items, {"test_a.py::x": UNLISTED_SECONDS + 1}, workers=1)] == [
        "test_a.py::x", "test_new.py::x"]
