"""Prometheus remote write 1.0 on the wire: ``prometheus.WriteRequest`` declared by hand, snappy block format.

The messages are the subset of ``prompb/remote.proto`` and ``prompb/types.proto`` (Prometheus, Apache-2.0) a
receiver of samples needs, declared as a descriptor at import (no generated code): ``WriteRequest.timeseries``
(field 1), ``TimeSeries.labels`` (1) and ``.samples`` (2), ``Label.name``/``.value`` (1, 2), ``Sample.value``
(double, 1) and ``.timestamp`` (int64 milliseconds, 2). Other fields (metadata, exemplars, native histograms)
are skipped by the protobuf runtime as unknown fields. The body is snappy's *block* format (not the framed
one), whose first bytes are the uncompressed length as a varint: :func:`decode` checks it against a limit
before decompressing, so a small body cannot expand past it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import cramjam
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

__all__ = ["DecodeError", "WireError", "decode", "encode", "uncompressed_length"]


class WireError(ValueError):
    """A remote write body that is not valid snappy or protobuf, or larger than allowed (the message says which)."""


def _message_classes() -> tuple[type[Any], type[Any]]:
    f = descriptor_pb2.FileDescriptorProto(name="gpufleet/detector/remote_write.proto", package="gpufleet.prompb",
                                           syntax="proto3")
    t = descriptor_pb2.FieldDescriptorProto

    def msg(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = type_name

    opt, rep = t.LABEL_OPTIONAL, t.LABEL_REPEATED
    msg("Label", ("name", 1, t.TYPE_STRING, opt, ""), ("value", 2, t.TYPE_STRING, opt, ""))
    msg("Sample", ("value", 1, t.TYPE_DOUBLE, opt, ""), ("timestamp", 2, t.TYPE_INT64, opt, ""))
    msg("TimeSeries", ("labels", 1, t.TYPE_MESSAGE, rep, ".gpufleet.prompb.Label"),
        ("samples", 2, t.TYPE_MESSAGE, rep, ".gpufleet.prompb.Sample"))
    msg("WriteRequest", ("timeseries", 1, t.TYPE_MESSAGE, rep, ".gpufleet.prompb.TimeSeries"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("gpufleet.prompb.WriteRequest")),
            get(pool.FindMessageTypeByName("gpufleet.prompb.TimeSeries")))


WriteRequest, TimeSeries = _message_classes()

#: One series of a request: its labels (``__name__`` included, as sent) and its samples (ms, value).
Wire = tuple[dict[str, str], list[tuple[int, float]]]


def uncompressed_length(body: bytes) -> int:
    """The uncompressed length a snappy block states in its leading varint (WireError when it has none)."""
    n = shift = 0
    for i, b in enumerate(body[:10]):
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n
        shift += 7
        if i == 4:  # snappy's length is a 32-bit varint: at most 5 bytes
            break
    raise WireError("not snappy: no block length")


def decode(body: bytes, max_bytes: int) -> Any:
    """The ``WriteRequest`` in a snappy-compressed ``body`` whose uncompressed size is at most ``max_bytes``."""
    size = uncompressed_length(body)
    if size > max_bytes:
        raise WireError(f"uncompressed body of {size} bytes is over the limit of {max_bytes}")
    try:
        raw = bytes(cramjam.snappy.decompress_raw(body))
    except Exception as e:  # cramjam raises its own DecompressionError (and ValueError) for corrupt input
        raise WireError(f"not snappy: {e}") from None
    req = WriteRequest()
    try:
        req.ParseFromString(raw)
    except DecodeError as e:
        raise WireError(f"not a prometheus.WriteRequest: {e}") from None
    return req


def encode(series: Iterable[tuple[Mapping[str, str], Iterable[tuple[int, float]]]]) -> bytes:
    """A snappy-compressed ``WriteRequest`` of ``(labels, [(ms, value), ...])`` (tests and benches send these)."""
    req = WriteRequest()
    for labels, samples in series:
        ts = req.timeseries.add()
        for k, v in sorted(labels.items()):
            ts.labels.add(name=k, value=v)
        for ms, value in samples:
            ts.samples.add(timestamp=ms, value=value)
    return bytes(cramjam.snappy.compress_raw(req.SerializeToString()))
