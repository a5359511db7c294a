"""pytest plugin (entry point ``pytest11``): kvspec's options for a user's suite."""
from __future__ import annotations


def pytest_addoption(parser) -> None:
    g = parser.getgroup("kvspec", "kvspec allocator verification")
    g.addoption("--kvspec-target", default=None, help="run kvspec's machines against this target")
    g.addoption("--kvspec-level", default="all", choices=["pool", "cache", "all"])
    g.addoption("--kvspec-budget", type=float, default=None, help="seconds per machine")
