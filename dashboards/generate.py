"""Generate the Grafana dashboard JSON from the ``*.dashboard.py`` sources.

``gpufleet-dashboards`` writes ``dashboards/json/<uid>.json`` for every
``dashboards/*.dashboard.py`` (each module defines ``dashboard``, a grafanalib
Dashboard). ``--check`` writes nothing: it exits 1 and lists every JSON file that
differs from its source (or is missing, or has no source), so CI catches drift.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder

HERE = Path(__file__).resolve().parent


def sources(directory: Path = HERE) -> list[Path]:
    return sorted(directory.glob("*.dashboard.py"))


def load(path: Path) -> Any:
    """The ``dashboard`` object a ``*.dashboard.py`` file defines."""
    name = "gpufleet_dashboard_" + path.name.removesuffix(".dashboard.py").replace("-", "_")
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise SystemExit(f"{path}: cannot load")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    dash = getattr(module, "dashboard", None)
    if dash is None or not hasattr(dash, "to_json_data"):
        raise SystemExit(f"{path}: defines no grafanalib `dashboard`")
    return dash


def render(dash: Any) -> str:
    """Deterministic JSON text of a dashboard (sorted keys, 2-space indent, trailing newline)."""
    buf = io.StringIO()
    json.dump(dash.to_json_data(), buf, sort_keys=True, indent=2, cls=DashboardEncoder)
    return buf.getvalue() + "\n"


def generate(directory: Path = HERE) -> dict[str, str]:
    """File name -> JSON text for every dashboard source; uids must be set and unique."""
    out: dict[str, str] = {}
    for path in sources(directory):
        dash = load(path)
        if not dash.uid:
            raise SystemExit(f"{path}: dashboard has no uid")
        fname = f"{dash.uid}.json"
        if fname in out:
            raise SystemExit(f"{path}: duplicate dashboard uid {dash.uid}")
        out[fname] = render(dash)
    return out


def drift(directory: Path = HERE, out_dir: Path | None = None) -> list[str]:
    """Problems between the sources and the committed JSON (empty when in sync)."""
    out_dir = out_dir or directory / "json"
    wanted = generate(directory)
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
        problems = drift(HERE, args.out)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run gpufleet-dashboards to regenerate", file=sys.stderr)
            return 1
        print(f"{len(sources())} dashboards in sync")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    texts = generate(HERE)
    for fname, text in texts.items():
        (args.out / fname).write_text(text)
    for path in sorted(args.out.glob("*.json")):
        if path.name not in texts:
            path.unlink()
    print(f"wrote {len(texts)} dashboards to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
