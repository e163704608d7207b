"""NCCL's example profiler plugin traces: per-rank collective timing from the dump files.

NCCL (2.23 and newer) loads a profiler plugin named by ``NCCL_PROFILER_PLUGIN``; its example
plugin (``ext-profiler/example`` in NVIDIA/nccl) writes, for each process, a file
``${NCCL_PROFILE_DUMP_FILE}-<hostname>-<tid>.txt`` in the Chrome trace event format: a JSON array
with one event per line. A collective is a pair of asynchronous events of category ``COLL``,
``"ph": "b"`` (with ``args``: ``SeqNum``, ``CommHash``, ``Rank``, ``Count``, ``Datatype``,
``Algorithm``, ``Protocol``, ``nChannels`` or ``nMaxChannels``) and ``"ph": "e"`` with the same
``id``; ``ts`` is in microseconds. With proxy events enabled (``NCCL_PROFILE_EVENT_MASK`` with
``ncclProfileProxyOp``, 8) the end is when the rank's network operations finished, so a rank
whose peers wait shows long collectives; without them an intra-node collective's duration is
only its launch time.

:func:`parse_trace` reads the text line by line, so a file still being written (a last,
incomplete line) parses as far as it goes; lines that are not events of interest are skipped,
a line that is not JSON is counted as malformed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

#: The collectives given their own label value; anything else is "other" (bounded cardinality).
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "AllToAll")
#: NCCL datatype names (ncclDataType_t, as the plugin prints them) -> bytes per element.
DATATYPE_BYTES = {
    "ncclInt8": 1, "ncclChar": 1, "ncclUint8": 1, "ncclInt32": 4, "ncclInt": 4, "ncclUint32": 4,
    "ncclInt64": 8, "ncclUint64": 8, "ncclFloat16": 2, "ncclHalf": 2, "ncclFloat32": 4, "ncclFloat": 4,
    "ncclFloat64": 8, "ncclDouble": 8, "ncclBfloat16": 2, "ncclFloat8e4m3": 1, "ncclFloat8e5m2": 1,
}
#: Dump file names the collector attributes: ``[<job id>.]gpu<index>-<hostname>-<tid>.txt``
#: (``NCCL_PROFILE_DUMP_FILE=<dir>/<job id>.gpu<index>`` per rank; see docs/install-gpu-hosts.md).
FILE_NAME = re.compile(r"^(?:(?P<job>[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,127})\.)?gpu(?P<gpu>0|[1-9][0-9]{0,3})-.+\.txt$")


@dataclass
class CollStats:
    """Completed collectives of one kind on one communicator in one trace."""

    count: int = 0
    seconds: float = 0.0
    #: payload bytes (``Count`` x datatype size) summed over the collectives
    payload: float = 0.0


@dataclass
class TraceSummary:
    """What one dump file says: completed collectives by (kind, communicator), the highest rank seen on each
    communicator, and how many lines could not be used."""

    collectives: dict[tuple[str, int], CollStats] = field(default_factory=dict)
    top_rank: dict[int, int] = field(default_factory=dict)
    malformed_lines: int = 0


def bus_factor(kind: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor on the payload (``Count`` x datatype size, per rank)."""
    n = max(nranks, 1)
    if kind == "AllReduce":
        return 2.0 * (n - 1) / n
    if kind in ("AllGather", "ReduceScatter"):
        return float(n - 1)  # payload is one rank's share; busBw = share x (n-1) / time
    if kind == "AllToAll":
        return (n - 1) / n
    return 1.0


def parse_trace(text: str) -> TraceSummary:
    """Summarize the completed ``COLL`` events of one dump file (see the module docstring).

    The communicator size is not in the trace: :func:`bus_factor` takes it from the highest
    ``Rank`` seen for the communicator (``top_rank``, over all the files of a host), a lower bound for
    a communicator that spans hosts, so the bus bandwidth errs low, never high.
    """
    out = TraceSummary()
    open_: dict[tuple[int, int], tuple[str, float, int, int, int]] = {}  # (pid, id) -> (kind, ts, comm, rank, bytes)
    top_rank = out.top_rank
    for raw in text.splitlines():
        line = raw.strip().rstrip(",")
        if not line or line in ("[", "]", "{}", "{}]"):
            continue
        if '"COLL"' not in line:
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            out.malformed_lines += 1
            continue
        if not isinstance(ev, dict) or ev.get("cat") != "COLL":
            continue
        try:
            key = (int(ev["pid"]), int(ev["id"]))
            ts = float(ev["ts"])
            ph = ev["ph"]
            if ph == "b":
                args = ev["args"]
                kind = str(ev["name"])
                comm, rank, count = int(args["CommHash"]), int(args["Rank"]), int(args["Count"])
                size = DATATYPE_BYTES.get(str(args["Datatype"]), 0)
                if rank < 0 or count < 0:
                    raise ValueError("negative rank or count")
                open_[key] = (kind if kind in COLLECTIVES else "other", ts, comm, rank, count * size)
                top_rank[comm] = max(top_rank.get(comm, 0), rank)
            elif ph == "e":
                start = open_.pop(key, None)
                if start is not None and ts >= start[1]:
                    st = out.collectives.setdefault((start[0], start[2]), CollStats())
                    st.count += 1
                    st.seconds += (ts - start[1]) / 1e6
                    st.payload += start[4]
        except (KeyError, TypeError, ValueError):
            out.malformed_lines += 1
    return out
