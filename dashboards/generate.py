"""Generate the Grafana dashboard JSON from the dashboard modules.

``gpufleet-dashboards`` writes ``dashboards/json/<uid>.json`` for every module of
:mod:`gpufleet.dashboards.boards` (each defines ``dashboard``, a grafanalib
Dashboard). ``--check`` writes nothing: it exits 1 and lists every JSON file that
differs from its source (or is missing, or has no source), so CI catches drift.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

from gpufleet.dashboards.boards import dcgm, health, job, network, node, overview, power, rack

HERE = Path(__file__).resolve().parent
#: Every dashboard module, in the order they are generated.
BOARDS: tuple[ModuleType, ...] = (dcgm, health, job, network, node, overview, power, rack)


def render(dash: g.Dashboard) -> str:
    """Deterministic JSON text of a dashboard (sorted keys, 2-space indent, trailing newline)."""
    buf = io.StringIO()
    json.dump(dash.to_json_data(), buf, sort_keys=True, indent=2, cls=DashboardEncoder)
    return buf.getvalue() + "\n"


def generate(boards: Sequence[ModuleType] = BOARDS) -> dict[str, str]:
    """File name -> JSON text for every dashboard module; uids must be set and unique."""
    out: dict[str, str] = {}
    for module in boards:
        dash = getattr(module, "dashboard", None)
        if not isinstance(dash, g.Dashboard):
            raise SystemExit(f"{module.__name__}: defines no grafanalib `dashboard`")
        if not dash.uid:
            raise SystemExit(f"{module.__name__}: dashboard has no uid")
        fname = f"{dash.uid}.json"
        if fname in out:
            raise SystemExit(f"{module.__name__}: duplicate dashboard uid {dash.uid}")
        out[fname] = render(dash)
    return out


def drift(out_dir: Path = HERE / "json") -> list[str]:
    """Problems between the dashboard modules and the committed JSON (empty when in sync)."""
    wanted = generate()
    problems = []
    for fname, text in wanted.items():
        path = out_dir / fname
        if not path.exists():
            problems.append(f"{path}: missing")
        elif path.read_text() != text:
            problems.append(f"{path}: differs from its source")
    for path in sorted(out_dir.glob("*.json")):
        if path.name not in wanted:
            problems.append(f"{path}: no dashboard source generates it")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpufleet-dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 listing files that drifted from their source")
    parser.add_argument("--out", type=Path, default=HERE / "json", help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift(args.out)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run gpufleet-dashboards to regenerate", file=sys.stderr)
            return 1
        print(f"{len(BOARDS)} dashboards in sync")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    texts = generate()
    for fname, text in texts.items():
        (args.out / fname).write_text(text)
    for path in sorted(args.out.glob("*.json")):
        if path.name not in texts:
            path.unlink()
    print(f"wrote {len(texts)} dashboards to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
