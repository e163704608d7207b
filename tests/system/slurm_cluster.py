"""A real Slurm cluster on 127.0.0.1 for tests: Debian's munged, slurmctld and slurmd, everything under a tmp dir.

One slurmd runs (as the first node named); the other nodes are defined and never start (DOWN). The munge key,
sockets, state, spool, logs and slurm.conf live under the test's directory; ports are free ones on 127.0.0.1.
tests/run.sh installs the packages (slurmctld, slurmd, munge).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from support import free_port, need_binary, running

CONF = """\
ClusterName=gpufleet-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
ReturnToService=2
SlurmdTimeout=300
{nodes}
PartitionName=gpu Nodes={names} Default=YES State=UP
"""


@contextlib.contextmanager
def slurm_cluster(tmp: Path, nodes: Sequence[str]) -> Iterator[dict[str, str]]:
    """Yields the environment (``SLURM_CONF``) under which ``scontrol`` talks to the cluster."""
    d = tmp / "slurm"
    for sub in ("state", *(f"spool/{n}" for n in nodes)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node_lines = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN"
                           for n in nodes)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(ctld_port=free_port(), slurmd_port=free_port(), d=d, nodes=node_lines,
                                names=",".join(nodes)))
    env = {"SLURM_CONF": str(conf)}
    with contextlib.ExitStack() as es:
        es.enter_context(running([need_binary("munged"), "-F", "-f", f"--key-file={key}",
                                  f"--socket={d / 'munge.sock'}", f"--pid-file={d / 'munged.pid'}",
                                  f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"],
                                 log=d / "munged.out"))
        _wait(lambda: (d / "munge.sock").exists(), "munged")
        es.enter_context(running([need_binary("slurmctld"), "-D", "-i"], env=env, log=d / "slurmctld.out"))
        es.enter_context(running([need_binary("slurmd"), "-D", "-N", nodes[0]], env=env, log=d / "slurmd.out"))
        full_env = {**os.environ, **env}
        _wait(lambda: "State=IDLE" in scontrol(full_env, "show", "node", nodes[0], "--oneliner"),
              f"slurmd {nodes[0]} idle")
        yield env


def scontrol(env: dict[str, str], *args: str) -> str:
    p = subprocess.run(["scontrol", *args], capture_output=True, text=True, env=env, timeout=30, check=False)
    return p.stdout + p.stderr


def _wait(ok: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(ok) and ok():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not up after {timeout:.0f} s")
