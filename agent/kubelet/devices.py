"""Which container holds which GPU, from a pod-resources ``List`` answer; device ids -> GPU index.

The kubelet names a device the way its device plugin or DRA driver announced it:

=====================================  ==========================================================
``GPU-<uuid>``                         a whole GPU (NVIDIA device plugin): its NVML UUID
``GPU-<uuid>::N``                      replica N of a GPU shared by time-slicing
``MIG-<uuid>``                         a MIG device (NVIDIA device plugin, driver R470 and later): its parent
                                      GPU from NVML's MIG devices (``GpuIds.by_mig_uuid``)
``MIG-GPU-<uuid>/<gi>/<ci>``           a MIG device, older drivers: the parent GPU's UUID is in it
``nvidiaN``                            a whole GPU by minor number (/dev/nvidiaN; GKE's plugin)
``nvidiaN/giG``                        a MIG device on GPU minor N (GKE's plugin)
``gpu-N``                              DRA (driver ``gpu.nvidia.com``): a whole GPU by minor number
``gpu-N-mig-<profile>-<start>-<size>`` DRA: a MIG device on GPU minor N
=====================================  ==========================================================

:func:`resolve` maps each to the physical GPU's index label (as every per-GPU series has it)
and UUID using the NVML inventory (:class:`GpuIds`), and keeps what the container holds as
``device`` (the replica suffix dropped: replicas of one GPU are one device). A device that
cannot be resolved (a MIG UUID of the current form, whose parent only NVML's MIG API knows;
a GPU NVML does not list; NVML down) keeps ``gpu`` and ``uuid`` empty.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # protobuf is needed only where an answer is parsed
    from gpufleet.agent.kubelet.podresources.v1 import api_pb2

_MINOR_RE = re.compile(r"^nvidia(\d{1,4})(/gi\d{1,4})?$")
_DRA_RE = re.compile(r"^gpu-(\d{1,4})(-mig-[0-9-]+)?$")
_OLD_MIG_RE = re.compile(r"^MIG-(GPU-[0-9A-Fa-f-]+)/\d+/\d+$")


class Holder(NamedTuple):
    """One device held by one container, as the kubelet reports it."""

    namespace: str
    pod: str
    container: str
    resource: str  # extended resource name, or the DRA driver's name
    device: str  # device id (device plugin) or device name (DRA)
    dra: bool = False


@dataclass(frozen=True)
class GpuIds:
    """This host's GPUs as NVML lists them: UUID and minor number -> index label."""

    by_uuid: Mapping[str, str] = field(default_factory=dict)  # lower-cased UUID -> index
    by_minor: Mapping[int, str] = field(default_factory=dict)  # minor number -> index
    uuid_of: Mapping[str, str] = field(default_factory=dict)  # index -> UUID as NVML reports it
    by_mig_uuid: Mapping[str, str] = field(default_factory=dict)  # lower-cased MIG device UUID -> parent index

    @classmethod
    def of(cls, gpus: Iterable[tuple[str, str, int | None]]) -> GpuIds:
        """From (index label, UUID, minor number or None) triples."""
        by_uuid: dict[str, str] = {}
        by_minor: dict[int, str] = {}
        uuid_of: dict[str, str] = {}
        for index, uuid, minor in gpus:
            if uuid:
                by_uuid[uuid.lower()] = index
                uuid_of[index] = uuid
            if minor is not None:
                by_minor[minor] = index
        return cls(by_uuid, by_minor, uuid_of)


class Resolved(NamedTuple):
    gpu: str  # index label, "" when unresolved
    uuid: str  # physical GPU's UUID, "" when unknown
    device: str  # what the container holds (replica suffix dropped)


def resolve(holder: Holder, ids: GpuIds) -> Resolved:
    """The physical GPU behind ``holder.device`` (see the module docstring for the forms)."""
    device = holder.device.split("::", 1)[0]  # time-slicing replica "UUID::N" -> the GPU
    parent = ""  # the physical GPU's UUID when the id itself names it
    if holder.dra:
        m = _DRA_RE.match(device)
        index = ids.by_minor.get(int(m.group(1))) if m else ids.by_uuid.get(device.lower())
    elif m := _MINOR_RE.match(device):
        index = ids.by_minor.get(int(m.group(1)))
    elif m := _OLD_MIG_RE.match(device):
        parent = m.group(1)
        index = ids.by_uuid.get(parent.lower())
    else:  # GPU-<uuid>, or a current MIG-<uuid> (its parent from NVML's MIG devices)
        parent = device if device.startswith("GPU-") else ""
        index = ids.by_uuid.get(device.lower()) or ids.by_mig_uuid.get(device.lower())
    if index is None:
        return Resolved("", parent, device)
    return Resolved(index, ids.uuid_of.get(index, parent), device)


def matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def holders(response: api_pb2.ListPodResourcesResponse, patterns: Sequence[str]) -> list[Holder]:
    """Every (container, device) pair of the answer whose resource (device plugin) or driver (DRA)
    name matches one of ``patterns`` (shell-style, e.g. ``nvidia.com/mig-*``); the rest is ignored."""
    out: dict[Holder, None] = {}
    for pod in response.pod_resources:
        for ctr in pod.containers:
            for devs in ctr.devices:
                if matches(devs.resource_name, patterns):
                    for dev_id in devs.device_ids:
                        out[Holder(pod.namespace, pod.name, ctr.name, devs.resource_name, dev_id)] = None
            for dyn in ctr.dynamic_resources:
                for claim in dyn.claim_resources:
                    if claim.device_name and matches(claim.driver_name, patterns):
                        out[Holder(pod.namespace, pod.name, ctr.name, claim.driver_name, claim.device_name,
                                   dra=True)] = None
    return list(out)
