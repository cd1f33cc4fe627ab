"""Who owns each GPU when its processes carry no client: Kubernetes pods (the kubelet's
pod-resources API) and Slurm jobs (a job-mapping directory the shipped prolog writes).

Both are host collectors, off by default. Each reads in the sampler's cycle at most every
REFRESH_SECONDS (the kubelet need not answer every second) and names GPUs by UUID or index;
the render maps them to the snapshot's ``gpu`` and ``uuid`` labels, so a GPU the node does not
have is left out.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from exporter.reading.collectors.base import HostCollector
from exporter.reading.sampler import Snapshot

log = logging.getLogger(__name__)

REFRESH_SECONDS = 10.0
MAX_FILES = 1024  # in a job-mapping directory
MAX_FILE_BYTES = 4096
_JOB = re.compile(r"[A-Za-z0-9_.:+-]{1,128}")
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCE_PREFIX = "nvidia.com/"  # nvidia.com/gpu, nvidia.com/mig-1g.10gb, ...


def _gpu_labels(snapshot: Snapshot) -> dict[str, tuple[str, str]]:
    """What a device may be named by (UUID or index) -> its (gpu, uuid) labels."""
    out = {}
    for g in snapshot.gpus:
        ident = g.identity
        out[ident.index] = (ident.index, ident.uuid)
        if ident.uuid:
            out[ident.uuid] = (ident.index, ident.uuid)
    return out


class _Refreshing(HostCollector):
    """A reading kept for REFRESH_SECONDS: the sources change when jobs start and end."""

    def __init__(self, psutil_module: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(psutil_module)
        self._clock = clock
        self._cached: tuple[float, Any, Exception | None] | None = None

    def read(self) -> Any:
        """The last fetch's reading, or its error again, until it is REFRESH_SECONDS old: a
        source that fails (no kubelet socket) is not retried every cycle either."""
        now = self._clock()
        if self._cached is None or now - self._cached[0] >= REFRESH_SECONDS:
            try:
                self._cached = (now, self.fetch(), None)
            except Exception as exc:
                self._cached = (now, None, exc)
        if self._cached[2] is not None:
            raise self._cached[2]
        return self._cached[1]

    def fetch(self) -> Any:
        raise NotImplementedError


class SlurmCollector(_Refreshing):
    """``gputrain_gpu_job_info{gpu,uuid,job}`` from a directory holding a file per GPU (named
    by its index or UUID) whose lines are the Slurm jobs using it, as dcgm-exporter's
    ``--hpc-job-mapping-dir`` reads it; ``deploy/slurm/gputrain-prolog.sh`` writes them."""

    name = "slurm"

    def __init__(self, psutil_module: Any = None, directory: str = "/run/gputrain/slurm-gpus",
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(psutil_module, clock)
        self.directory = directory

    def fetch(self) -> dict[str, tuple[str, ...]]:
        """GPU reference -> the jobs its file names. A missing directory is no job at all
        (the prolog makes it with the first job); an unreadable one fails the cycle."""
        try:
            names = sorted(os.listdir(self.directory))[:MAX_FILES]
        except FileNotFoundError:
            return {}
        out = {}
        for name in names:
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8",
                          errors="replace") as fh:
                    text = fh.read(MAX_FILE_BYTES)
            except (IsADirectoryError, FileNotFoundError):
                continue  # a directory, or a file the epilog removed meanwhile
            jobs = tuple(dict.fromkeys(x for x in text.split() if _JOB.fullmatch(x)))
            if jobs:
                out[name] = jobs
        return out

    def families(self) -> tuple[GaugeMetricFamily]:
        return (GaugeMetricFamily(
            "gputrain_gpu_job_info", "The Slurm job using the GPU, from the job-mapping "
            "directory (--slurm.job-mapping-dir); always 1. Prometheus stores the `job` label "
            "as `exported_job` (honor_labels: false).", labels=["gpu", "uuid", "job"]),)

    def render_snapshot(self, reading: dict[str, tuple[str, ...]],
                        snapshot: Snapshot) -> Iterator[Metric]:
        (info,) = self.families()
        gpus = _gpu_labels(snapshot)
        for ref, jobs in reading.items():
            if ref in gpus:
                for job in jobs:
                    info.add_metric([*gpus[ref], job], 1)
        yield info


class KubernetesCollector(_Refreshing):
    """``gputrain_gpu_pod_info{gpu,uuid,namespace,pod,container}`` from the kubelet's
    pod-resources API (``v1.PodResourcesLister/List`` over its unix socket): the devices of
    every ``nvidia.com/*`` resource a container was given."""

    name = "kubernetes"
    TIMEOUT_SECONDS = 5.0

    def __init__(self, psutil_module: Any = None, socket_path: str = POD_RESOURCES_SOCKET,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(psutil_module, clock)
        self.socket_path = socket_path
        self._channel: Any = None

    def fetch(self) -> list[tuple[str, str, str, str]]:
        """(device id, namespace, pod, container) for each GPU a container holds."""
        try:
            import grpc
        except ImportError:
            raise RuntimeError("the kubernetes collector needs grpcio: pip install "
                               "'gputrain-exporter[kubernetes]'") from None
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        call = self._channel.unary_unary("/v1.PodResourcesLister/List",
                                         request_serializer=lambda _: b"",
                                         response_deserializer=parse_list_response)
        try:
            pods = call(None, timeout=self.TIMEOUT_SECONDS)
        except grpc.RpcError as exc:
            raise RuntimeError(f"the kubelet's pod-resources socket {self.socket_path}: "
                               f"{exc.code().name}: {exc.details()}") from None
        return [(device, ns, pod, container)
                for ns, pod, container, resource, devices in pods
                if resource.startswith(GPU_RESOURCE_PREFIX) for device in devices]

    def families(self) -> tuple[GaugeMetricFamily]:
        return (GaugeMetricFamily(
            "gputrain_gpu_pod_info", "The Kubernetes pod and container a GPU is allocated to, "
            "from the kubelet's pod-resources API; always 1.",
            labels=["gpu", "uuid", "namespace", "pod", "container"]),)

    def render_snapshot(self, reading: list[tuple[str, str, str, str]],
                        snapshot: Snapshot) -> Iterator[Metric]:
        (info,) = self.families()
        gpus = _gpu_labels(snapshot)
        for device, ns, pod, container in sorted(set(reading)):
            if device in gpus:
                info.add_metric([*gpus[device], ns, pod, container], 1)
        yield info


# -- the pod-resources v1 messages, read from protobuf's wire format ---------------------------
# ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
# PodResources { string name = 1; string namespace = 2;
#                repeated ContainerResources containers = 3; }
# ContainerResources { string name = 1; repeated ContainerDevices devices = 2; ... }
# ContainerDevices { string resource_name = 1; repeated string device_ids = 2; ... }


def _fields(data: bytes) -> Iterator[tuple[int, bytes | int]]:
    """(field number, value) of one message: length-delimited values as bytes, varints as
    int; fixed-width values are skipped (none of the fields read here has one)."""
    i, n = 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            yield number, value
        elif wire == 2:
            length, i = _varint(data, i)
            if i + length > n:
                raise ValueError("a length-delimited field runs past the message")
            yield number, data[i:i + length]
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("a truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _group(data: bytes) -> dict[int, list[bytes]]:
    """A message's length-delimited fields (strings, bytes, sub-messages) by field number."""
    out: dict[int, list[bytes]] = {}
    for number, value in _fields(data):
        if isinstance(value, bytes):
            out.setdefault(number, []).append(value)
    return out


def _text(fields: dict[int, list[bytes]], number: int) -> str:
    return fields[number][-1].decode() if fields.get(number) else ""


def parse_list_response(data: bytes) -> list[tuple[str, str, str, str, tuple[str, ...]]]:
    """(namespace, pod, container, resource name, device ids) for every device group of a
    ``ListPodResourcesResponse``."""
    out = []
    for pod in map(_group, _group(data).get(1, [])):
        for container in map(_group, pod.get(3, [])):
            for devices in map(_group, container.get(2, [])):
                out.append((_text(pod, 2), _text(pod, 1), _text(container, 1),
                            _text(devices, 1), tuple(d.decode() for d in devices.get(2, []))))
    return out
