"""When the hooks' compiled path may run (``collectives.fast.why_not``): only
a build of this very source, for this torch, and never under GRADFABRIC_PURE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradfabric.collectives import fast


def _manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fields: str) -> None:
    path = tmp_path / "_fast_hook.json"
    if fields:
        path.write_text(json.dumps(fields))
    monkeypatch.setattr(fast, "MANIFEST", path)
    monkeypatch.delenv("GRADFABRIC_PURE", raising=False)


def test_a_missing_stale_or_foreign_build_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _manifest(tmp_path, monkeypatch)
    assert "not built" in (fast.why_not() or "")
    _manifest(tmp_path, monkeypatch, source="0" * 16, torch=torch.__version__)
    assert "source changed" in (fast.why_not() or "")
    _manifest(tmp_path, monkeypatch, source=fast.source_digest(), torch="0.0.1")
    assert "built for torch 0.0.1" in (fast.why_not() or "")


def test_the_pure_python_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADFABRIC_PURE", "1")
    assert fast.why_not() == "GRADFABRIC_PURE is set"
