"""The counts the docs state (alerts, dashboards) are the shipped ones, and no doc points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "alerts/runbook.md", ROOT / "tests/README.md",
                *ROOT.glob("packaging/**/*.md")])
WORDS = {w: i for i, w in enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"])}
COUNT = re.compile(r"\b(\d+|" + "|".join(WORDS) + r") (alerts|dashboards)\b", re.I)


def _alerts() -> dict[str, int]:
    """Alerts per rule group, and "" for all of them."""
    groups = yaml.safe_load((ROOT / "alerts/gpufleet.rules.yml").read_text())["groups"]
    out = {g["name"]: sum(1 for r in g["rules"] if "alert" in r) for g in groups}
    out[""] = sum(out.values())
    return out


def _sentence(text: str, pos: int) -> str:
    start = max(text.rfind(". ", 0, pos), text.rfind("\n\n", 0, pos), 0)
    end = min(x for x in (text.find(". ", pos), text.find("\n\n", pos), len(text)) if x >= 0)
    return text[start:end]


def stated_counts() -> list[tuple[str, str, int, int]]:
    """(page, what, stated, shipped) for every "N alerts" / "N dashboards" in the pages."""
    alerts = _alerts()
    dashboards = len(list((ROOT / "dashboards/json").glob("*.json")))
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in COUNT.finditer(text):
            n = int(m.group(1)) if m.group(1).isdigit() else WORDS[m.group(1).lower()]
            what = m.group(2).lower()
            if what == "dashboards":
                out.append((page.name, what, n, dashboards))
                continue
            group = re.search(r"group `([a-z_.]+)`", _sentence(text, m.start()))
            out.append((page.name, f"alerts{' of ' + group.group(1) if group else ''}", n,
                        alerts[group.group(1)] if group else alerts[""]))
    return out


def test_the_docs_state_counts() -> None:
    assert {w for _, w, _, _ in stated_counts()} >= {"alerts", "dashboards"}  # the check has something to check


@pytest.mark.parametrize(("page", "what", "stated", "shipped"), stated_counts())
def test_every_stated_count_is_the_shipped_one(page: str, what: str, stated: int, shipped: int) -> None:
    assert stated == shipped, f"{page} says {stated} {what}; there are {shipped}"


def test_no_doc_points_outside_the_repository() -> None:
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in PAGES for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"(^|[\s`(\"'=])\.\./shared\b|/work/", line)]
    assert bad == []
