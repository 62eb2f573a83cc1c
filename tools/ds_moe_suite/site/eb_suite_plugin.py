"""ds_moe_suite's pytest plugin (`-p eb_suite_plugin`): tell workers the running test, record outcomes.

* At the start of each test it writes the test id to $EB_DS_SUITE_DIR/current_test, so the worker
  processes that DeepSpeed's DistributedTest starts can tag their evidence lines with it
  (one pytest runs at a time, tests run one after another).
* It keeps one outcome per test id -- passed, failed, skipped or error (setup/teardown failure,
  or a module that failed to import) -- with the first line of the failure or the skip reason,
  and writes them as JSON to $EB_DS_SUITE_RESULTS after every test (a run killed on its time limit
  keeps what finished) and at the end of the session.
* With $EB_DS_SUITE_COLLECTED set it writes the collected test ids there (the runner's --collect-only).
"""
import json
import os
import re
import time

_results = {}
_started = {}


def _first_line(report):
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:          # a skip: (file, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if "Traceback (most recent call last)" in lines[0]:     # a worker's traceback handed to pytest.fail
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
        lines = [(errors or lines)[-1]]
    if lines[0].startswith("Skipped: "):
        lines[0] = lines[0][len("Skipped: "):]
    return lines[0][:400]


def pytest_runtest_logstart(nodeid, location):
    d = os.environ.get("EB_DS_SUITE_DIR")
    _started[nodeid] = time.time()
    if d:
        tmp = os.path.join(d, "current_test.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(nodeid)
        os.replace(tmp, os.path.join(d, "current_test"))


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": None, "message": "", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + getattr(report, "duration", 0.0), 2)
    if report.when == "setup":
        if report.failed:
            entry.update(outcome="error", message="setup: " + _first_line(report))
        elif report.skipped:
            entry.update(outcome="skipped", message=_first_line(report))
    elif report.when == "call":
        if report.failed:
            entry.update(outcome="failed", message=_first_line(report))
        elif report.skipped:
            entry.update(outcome="skipped", message=_first_line(report))
        elif report.passed:
            entry.update(outcome="passed")
    elif report.when == "teardown":
        if report.failed and entry["outcome"] in (None, "passed"):
            entry.update(outcome="error", message="teardown: " + _first_line(report))
        _dump(None)


def pytest_collectreport(report):
    if report.failed:
        _results[report.nodeid or "<collection>"] = {"outcome": "error", "duration_s": 0.0,
                                                     "message": "collection: " + _first_line(report)}
        _dump(None)


def pytest_collection_finish(session):
    path = os.environ.get("EB_DS_SUITE_COLLECTED")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump([item.nodeid for item in session.items], f)


def pytest_sessionfinish(session, exitstatus):
    _dump(int(exitstatus))


def _dump(exitstatus):
    path = os.environ.get("EB_DS_SUITE_RESULTS")
    if path:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"exitstatus": exitstatus, "tests": _results}, f, indent=1)
        os.replace(path + ".tmp", path)
