"""Who owns a process, from ``/proc/PID/cgroup``: a Slurm job, a Kubernetes pod or a systemd unit.

``/proc/PID/cgroup`` (``proc(5)``) has one line per hierarchy, ``ID:CONTROLLERS:PATH``; cgroup v2 is
the single line ``0::PATH``. The owner is read from the path, in this order:

=============================================================  ==================================
``.../slurmstepd.scope/job_N/step_M/...`` (v2),                Slurm job ``N`` (``kind="slurm_job"``)
``.../slurm/uid_U/job_N/step_M/...`` (v1)
``.../kubepods-besteffort-pod<uid>.slice/...`` (systemd),       Kubernetes pod ``<uid>`` (``kind="k8s_pod"``,
``.../kubepods/burstable/pod<uid>/...`` (cgroupfs driver)      ``_`` in the systemd form read as ``-``)
``.../<name>.service`` or ``.../<name>.scope``                 systemd unit (``kind="systemd_unit"``; the
                                                               innermost ``.service``, else ``.scope``)
=============================================================  ==================================

Anything else (the root cgroup, a plain directory) has no owner (``kind="unknown"``). cgroup v2's
line wins when both are present; a v1-only host is read from its ``name=systemd`` line, else the
first line with a path below ``/``.

Reading another user's ``/proc/PID/cgroup`` needs no privilege (mode 0444) unless ``/proc`` is
mounted with ``hidepid=`` or the unit has ``ProtectProc=invisible``: then other users' processes
are invisible (ENOENT; with ``hidepid=noaccess``/``ProtectProc=noaccess`` they stay listed and the
read fails with EPERM, ``permission_denied``), and their owner is unknown (counted by the caller).
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass

_SLURM_RE = re.compile(r"/job_(\d{1,20})(?:/step_([A-Za-z0-9_.]{1,40}))?(?:/|$)")
_POD_SYSTEMD_RE = re.compile(r"kubepods(?:-[a-z]+)*-pod([0-9a-fA-F_]{8,64})\.slice")
_POD_CGROUPFS_RE = re.compile(r"/kubepods(?:/[a-z]+)?/pod([0-9a-fA-F-]{8,64})(?:/|$)")
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,200}\.(service|scope)$")
_MAX_BYTES = 16 * 1024

UNKNOWN = "unknown"
SLURM_JOB = "slurm_job"
K8S_POD = "k8s_pod"
SYSTEMD_UNIT = "systemd_unit"
#: Every owner kind (label values of the owner metrics).
KINDS = (SLURM_JOB, K8S_POD, SYSTEMD_UNIT, UNKNOWN)


@dataclass(frozen=True)
class Owner:
    kind: str
    id: str = ""
    #: the Slurm step ("0", "batch", "extern"); not exported (steps of a job are one owner)
    step: str = ""


NO_OWNER = Owner(UNKNOWN)


def owner_of_path(path: str) -> Owner:
    """The owner of a process in cgroup ``path`` (see the module docstring)."""
    m = _SLURM_RE.search(path)
    if m and ("slurm" in path):
        return Owner(SLURM_JOB, m.group(1), m.group(2) or "")
    m = _POD_SYSTEMD_RE.search(path)
    if m:
        return Owner(K8S_POD, m.group(1).replace("_", "-").lower())
    m = _POD_CGROUPFS_RE.search(path)
    if m:
        return Owner(K8S_POD, m.group(1).lower())
    parts = [p for p in path.split("/") if p]
    for suffix in ("service", "scope"):
        for part in reversed(parts):
            u = _UNIT_RE.match(part)
            if u and u.group(1) == suffix:
                return Owner(SYSTEMD_UNIT, part)
    return NO_OWNER


def parse_cgroup(text: str) -> Owner:
    """The owner named by the contents of a ``/proc/PID/cgroup`` file; ValueError if it is not one.

    A Slurm job or Kubernetes pod in any hierarchy wins (on a cgroup v1 host the job is only in the
    controllers' hierarchies, while ``name=systemd`` names slurmd's service); otherwise the systemd
    unit of the v2 line, else of ``name=systemd``, else of any line."""
    paths: list[str] = []  # v2 first, then name=systemd, then the controllers' hierarchies
    for line in text.splitlines():
        if not line:
            continue
        hid, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2 and hid.isdigit() and path.startswith("/")):
            raise ValueError(f"not a cgroup line: {line[:60]!r}")
        rank = 0 if (hid == "0" and controllers == "") else 1 if controllers == "name=systemd" else 2
        paths.append(f"{rank}{path}")
    if not paths:
        raise ValueError("no cgroup line")
    ordered = [p[1:] for p in sorted(paths, key=lambda p: p[0])]
    owners = [owner_of_path(p) for p in ordered]
    for o in owners:
        if o.kind in (SLURM_JOB, K8S_POD):
            return o
    return next((o for o in owners if o.kind != UNKNOWN), NO_OWNER)


class OwnerError(Exception):
    """The owner of a process could not be read; ``reason`` is the error label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_owner(procfs: str, pid: int) -> Owner:
    """The owner of process ``pid`` from ``<procfs>/<pid>/cgroup``; raises :class:`OwnerError`
    (``not_found``: exited or hidden by hidepid/ProtectProc; ``permission_denied``; ``unreadable``;
    ``unparsable``)."""
    path = os.path.join(procfs, str(pid), "cgroup")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise OwnerError(_reason(e)) from None
    try:
        data = os.read(fd, _MAX_BYTES + 1)
    except OSError as e:
        raise OwnerError(_reason(e)) from None
    finally:
        os.close(fd)
    if len(data) > _MAX_BYTES:
        raise OwnerError("unparsable")
    try:
        return parse_cgroup(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise OwnerError("unparsable") from None


def _reason(e: OSError) -> str:
    if e.errno in (errno.ENOENT, errno.ESRCH, errno.ENOTDIR):
        return "not_found"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission_denied"
    return "unreadable"


class OwnerCache:
    """``read_owner`` with each pid's answer (owner, or unknown after a failed read) kept ``ttl`` seconds
    while the pid runs on a GPU (a process keeps its cgroup), and failed reads counted by reason
    (``gpufleet_gpu_process_owner_errors_total``)."""

    def __init__(self, procfs: str, ttl: float = 60.0) -> None:
        self.procfs = procfs
        self.ttl = ttl
        self._cache: dict[int, tuple[float, Owner]] = {}
        self.errors: dict[str, int] = {}

    def owner(self, pid: int, now: float | None = None) -> Owner:
        t = time.monotonic() if now is None else now
        hit = self._cache.get(pid)
        if hit is not None and t - hit[0] < self.ttl:
            return hit[1]
        try:
            owner = read_owner(self.procfs, pid)
        except OwnerError as e:  # counted once per read; not read again before ttl (a hidden /proc stays hidden)
            self.errors[e.reason] = self.errors.get(e.reason, 0) + 1
            self._cache[pid] = (t, NO_OWNER)
            return NO_OWNER
        self._cache[pid] = (t, owner)
        return owner

    def forget_others(self, pids: set[int]) -> None:
        """Drop the cached owners of processes no longer running on a GPU."""
        for pid in [p for p in self._cache if p not in pids]:
            del self._cache[pid]


def slurm_job_exists(cgroupfs: str, job_id: str) -> bool | None:
    """Whether Slurm has a cgroup for ``job_id``: True/False, or None when the host has no Slurm
    cgroup hierarchy at all (v2 ``system.slice/slurmstepd.scope``, v1 ``<controller>/slurm``)."""
    roots = [os.path.join(cgroupfs, "system.slice", "slurmstepd.scope")]
    roots += [os.path.join(cgroupfs, c, "slurm") for c in ("freezer", "cpuset", "memory", "devices")]
    found_root = False
    for root in roots:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        found_root = True
        job = f"job_{job_id}"
        if job in names:
            return True
        for uid in (n for n in names if n.startswith("uid_")):  # v1: slurm/uid_U/job_N
            if os.path.isdir(os.path.join(root, uid, job)):
                return True
    return False if found_root else None
