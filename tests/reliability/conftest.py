import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from kvstore import config as settings

#: The long versions run with KVSTORE_LONG=1 (make test-long); CI runs the short ones.
LONG = settings.LONG.get()


@pytest.fixture
def trials():
    def count(short: int, long: int = 200) -> int:
        return long if LONG else short

    return count


class Figures:
    """Counts the suites measure (trials, kills mid-call, faults injected, inputs tried, data lost),
    keyed by suite and operation, plus the wall time pytest spent in each suite's tests."""

    def __init__(self):
        self.counts: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
        self.wall_s: dict[str, float] = defaultdict(float)
        self.started = time.time()

    def add(self, suite: str, operation: str, **counts: int) -> None:
        for name, value in counts.items():
            self.counts[suite][operation][name] += int(value)

    def to_dict(self) -> dict:
        return {
            "long": LONG,
            "started": self.started,
            "wall_s": {suite: round(seconds, 2) for suite, seconds in sorted(self.wall_s.items())},
            "suites": {
                suite: {op: dict(c) for op, c in sorted(ops.items())} for suite, ops in sorted(self.counts.items())
            },
        }


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_runtest_logreport(report):
    if "reliability" in report.nodeid:
        suite = Path(report.nodeid.split("::")[0]).stem
        _FIGURES.wall_s[suite] += report.duration


def _report_paths(config) -> list[Path]:
    paths = []
    try:
        paths.append(config._tmp_path_factory.getbasetemp() / "reliability.json")
    except (AttributeError, OSError):
        pass
    extra = settings.RELIABILITY_JSON.get()  # where the figures go besides the pytest temp dir (RELIABILITY.md)
    if extra is not None:
        paths.append(extra)
    return paths


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _FIGURES.counts:
        return
    document = _FIGURES.to_dict()
    for path in _report_paths(config):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
        terminalreporter.write_line(f"reliability figures written to {path}")
    terminalreporter.section("reliability figures" + (" (KVSTORE_LONG=1)" if LONG else " (CI counts)"))
    for suite, operations in document["suites"].items():
        terminalreporter.write_line(suite)
        for operation, counts in operations.items():
            shown = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            terminalreporter.write_line(f"  {operation}: {shown}")
    walls = ", ".join(f"{module} {seconds:.1f}" for module, seconds in document["wall_s"].items())
    terminalreporter.write_line(f"wall time (s): {walls}")
