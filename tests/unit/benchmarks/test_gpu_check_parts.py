"""benchmarks/gpu/check.py's own machinery: installing the missing wheels from the assets
folder, counting the device tests from pytest's JUnit XML, ending a child that runs past its
time, and sharing the time budget between the steps."""

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "gpu"))
import check


def make_wheel(folder: Path, module: str) -> Path:
    """A pure-Python wheel of one module whose `VALUE` is its name."""
    dist = f"{module}-1.0.dist-info"
    files = {f"{module}.py": f"VALUE = {module!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_only_the_wheels_of_missing_modules_are_installed(tmp_path, monkeypatch):
    wheels = tmp_path / "assets" / "wheels"
    wheels.mkdir(parents=True)
    for module in ("probe_missing", "probe_present"):
        make_wheel(wheels, module)
    present = tmp_path / "present"
    present.mkdir()
    (present / "probe_present.py").write_text("VALUE = 'already here'\n")
    monkeypatch.syspath_prepend(str(present))
    monkeypatch.setattr(check, "NEEDED_MODULES", ("probe_missing", "probe_present"))
    target = tmp_path / "site"

    report = check.install_missing(tmp_path / "assets", target)

    assert report["missing"] == ["probe_missing"]
    assert report["installed"] == ["probe_missing-1.0-py3-none-any.whl"]
    assert report["not_in_assets"] == []
    assert (target / "probe_missing.py").is_file()
    assert not (target / "probe_present.py").exists()
    probe = "import probe_missing; print(probe_missing.VALUE)"
    done = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(target)},
                          capture_output=True, text=True)
    assert done.stdout.strip() == "probe_missing"


def test_a_missing_module_without_a_wheel_is_named(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    monkeypatch.setattr(check, "NEEDED_MODULES", ("probe_nowhere",))
    report = check.install_missing(tmp_path, tmp_path / "site")
    assert report["missing"] == ["probe_nowhere"] and report["installed"] == []


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="2"
failures="1" skipped="1" tests="6">
<testcase classname="" name="tests.unit.test_needs_requests"><error message="collection failure"
>ImportError while importing test module
E   ModuleNotFoundError: No module named 'requests'</error></testcase>
<testcase classname="tests.unit.test_a" name="test_ok" />
<testcase classname="tests.unit.test_a" name="test_ok_too" />
<testcase classname="tests.unit.test_a" name="test_bad"><failure message="assert 0" /></testcase>
<testcase classname="tests.unit.test_a" name="test_fixture"><error message="setup failed" />
</testcase>
<testcase classname="tests.unit.test_a" name="test_later"><skipped message="no GPU" /></testcase>
</testsuite></testsuites>"""


def test_junit_counts_tell_tests_from_modules_that_did_not_import(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    counts = check.junit_counts(xml)
    assert counts == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1, "tests": 5,
                      "import_errors": ["tests.unit.test_needs_requests (ModuleNotFoundError: "
                                        "No module named 'requests')"]}


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left to a PID 1 that does not reap is not running)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_child_past_its_time_is_ended_with_what_it_started(tmp_path):
    args = argparse.Namespace(out=tmp_path, budget=60)
    runner = check.Runner(args, check.PLANS["cpu"], dict(os.environ), tmp_path)
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    status, seconds, log = runner.child("sleeper", [sys.executable, "-c", script], timeout=3)
    assert status == "timeout" and 3 <= seconds < 30
    assert log.read_text().strip() == "started"
    assert not alive(int(pid_file.read_text()))


def test_later_steps_keep_their_floors_and_a_step_below_its_floor_is_not_started(tmp_path):
    plan = check.Plan(budget=100, grpo_steps=1, caps={"build": 80, "tests": 50, "grpo": 50},
                      floors={"build": 10, "tests": 20, "grpo": 20})
    runner = check.Runner(argparse.Namespace(out=tmp_path, budget=100), plan, {}, tmp_path)
    # 100 s left, 40 of them kept for tests and grpo: build gets 60 of its cap of 80
    assert 59 < runner.timeout("build", ["tests", "grpo"]) <= 60
    runner.deadline -= 75  # 25 s left: less grpo's 20, below the tests' floor of 20
    assert runner.timeout("tests", ["grpo"]) == 0.0
    assert 24 < runner.timeout("grpo", []) <= 25
    assert runner.timeout("build", ["tests", "grpo"]) == 10  # build runs at least its floor
