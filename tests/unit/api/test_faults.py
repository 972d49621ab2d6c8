"""Fault points: a named point of a named step kills the process, nothing else does."""

import subprocess
import sys

import pytest

from asyncrl.api import faults


def run_points(spec: str, points: list[tuple[str, int]]) -> subprocess.CompletedProcess:
    code = ("from asyncrl.api import faults\n"
            f"for name, step in {points!r}:\n"
            "    faults.point(name, step)\n"
            "    print(name, step, flush=True)\n")
    return subprocess.run([sys.executable, "-c", code], env={"ASYNCRL_FAULT": spec,
                          "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          check=False, timeout=60)


def test_the_named_point_and_step_kill_the_process_there():
    out = run_points("publish@3", [("publish", 2), ("train", 3), ("publish", 3),
                                   ("publish", 4)])
    assert out.returncode == -9
    assert out.stdout.split("\n")[:-1] == ["publish 2", "train 3"]


def test_unset_no_point_fires(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    for name in faults.POINTS:
        faults.point(name, 1)


@pytest.mark.parametrize("spec", ["train", "train@", "training@3", "train@x", "@3"])
def test_a_malformed_spec_is_named(monkeypatch, spec):
    monkeypatch.setenv(faults.ENV, spec)
    with pytest.raises(ValueError, match="ASYNCRL_FAULT=.*expected <point>@<step>"):
        faults.point("train", 3)
