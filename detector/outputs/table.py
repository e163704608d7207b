"""The findings as a table on the terminal (``replay --format table`` and ``report``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from gpufleet.detector.incidents.tracker import Finding


def print_table(findings: Sequence[Finding]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpufleet-detector findings ({len(findings)})")
    for col in ("kind", "cause", "site", "node", "gpu", "job", "start (UTC)", "end (UTC)", "score", "summary"):
        table.add_column(col, overflow="fold")

    def ts(x: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x)) if x is not None else "open"

    for f in findings:
        table.add_row(f.kind, f.cause or "", f.site or "", f.node or "", f.gpu or "", f.job or "", ts(f.start),
                      ts(f.end), f"{f.score:.1f}", f.summary)
    Console(width=None if sys.stdout.isatty() else 240).print(table)
