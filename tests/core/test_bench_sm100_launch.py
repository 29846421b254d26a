"""The CPU side of tools/bench/sm100_launch.py's timing loop (`measure`), with torch.cuda's synchronize, sleep and
events replaced by host stand-ins: which calls each column times, and that the idle column times one call at a
time."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import sm100_launch  # noqa: E402


class _Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):  # ms, as CUDA events report
        return (end.t - self.t) * 1e3


@pytest.fixture
def host_cuda(monkeypatch):
    """torch.cuda's calls that measure() makes, on the host; returns the log of synchronizes and calls."""
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append("sleep"))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return log


def test_measure_times_every_column_and_the_idle_one_call_at_a_time(host_cuda):
    def call():
        host_cuda.append("call")
        time.sleep(0.002)

    host, gpu, wall, idle = sm100_launch.measure(call, 8)
    # every column read about one call's 2 ms (generous bounds: a loaded CI machine sleeps longer)
    for us in (host, gpu, wall, idle):
        assert 1900 <= us <= 20000
    # per repeat: one call timed alone, 8 behind the sleep, 8 in the wall loop, then 8 idle calls, each after a
    # synchronize of its own
    per_repeat = ["sync", "call", "sync", "sleep", *["call"] * 8, "sync", *["call"] * 8, "sync",
                  *[x for _ in range(8) for x in ("sync", "call")], "sync"]
    assert host_cuda == per_repeat * 7


def test_measure_caps_the_idle_calls_at_fifty(host_cuda):
    host, gpu, wall, idle = sm100_launch.measure(lambda: host_cuda.append("call"), 200)
    assert host_cuda.count("call") == 7 * (1 + 200 + 200 + 50)
    assert min(host, gpu, wall, idle) >= 0.0
