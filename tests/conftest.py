"""Test configuration: hypothesis is derandomised under CI so a run is repeatable."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_report_header() -> str:
    from gradfabric._build import compiled_path

    return f"gradfabric simulator hot path: {compiled_path()}"
