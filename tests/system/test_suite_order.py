"""The suite's schedule (tests/conftest.py): the heavy files named there exist and are collected first."""

from __future__ import annotations

from pathlib import Path

import conftest
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_heavy_file_exists() -> None:
    missing = [p for p in conftest.HEAVY if not (ROOT / p).is_file()]
    assert not missing, f"tests/conftest.py HEAVY names files that are gone (renamed?): {missing}"


def test_heavy_files_are_collected_first(request: pytest.FixtureRequest) -> None:
    files = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in request.session.items))
    present = [p for p in conftest.HEAVY if p in files]
    assert files[:len(present)] == present, files[:len(present) + 2]
