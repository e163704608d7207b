"""The agent's exposition encoders: Prometheus text 0.0.4 and OpenMetrics 1.0, and format negotiation.

:func:`encode_text` and :func:`encode_openmetrics` give exactly what prometheus_client's
``generate_latest`` and ``openmetrics.exposition.generate_latest`` give for the agent's
families, several times faster: metric and label names come from the catalog (valid legacy
names, so no escaping), label sets carry their rendered prefix
(:class:`~gpufleet.agent.collectors.series.FrozenLabels`), the rendered line of a reused sample
(:class:`~gpufleet.agent.collectors.series.StickySample`) is kept on its label set (the same line in both
formats), and whole unchanged families are kept from one run to the next, per format. Whatever they do not handle (exemplars,
native histograms, an OpenMetrics-only family in the text format, a name that needs escaping)
goes to the reference encoder. :func:`negotiate` maps an ``Accept`` header to a :class:`Format`
exactly as prometheus_client's ``choose_encoder`` does.
"""

from __future__ import annotations

import operator
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.openmetrics import exposition as om
from prometheus_client.samples import Sample

from gpufleet.agent.collectors.series import PREFIXES, FrozenLabels, StickySample, label_prefix

_BLOCKS_LOCK = threading.Lock()
#: (family name, type) -> (samples, rendered block) of the families of the previous run made only of
#: StickySamples: a family with the very same samples again is copied as a whole.
_BLOCKS: dict[tuple[str, str], tuple[list[Sample], str]] = {}

_PROM_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary",
               "unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}
def encode_text(families: Sequence[Metric]) -> bytes:
    """Prometheus text format 0.0.4, byte-identical to ``prometheus_client.generate_latest``.

    About four times faster for gpufleet's families: metric and label names come from
    the catalog (valid legacy names, so no escaping checks) and rendered label sets are
    cached across scrapes.
    """
    with _BLOCKS_LOCK:
        blocks = dict(_BLOCKS)
    new_blocks: dict[tuple[str, str], tuple[list[Sample], str]] = {}
    float_memo = _FLOATS.get
    out: list[str] = []
    append = out.append
    get = PREFIXES.get
    for fam in families:
        name, mtype = fam.name, fam.type
        if mtype not in ("counter", "gauge"):  # OpenMetrics-only families: use the reference encoder
            return generate_latest(_Families(families))
        samples = fam.samples
        key = (name, mtype)
        block = blocks.get(key)
        if block is not None and len(block[0]) == len(samples) and all(map(operator.is_, block[0], samples)):
            append(block[1])  # the very samples of last time: the very same text
            new_blocks[key] = block
            continue
        start = len(out)
        whole = True  # only StickySamples without timestamps: the block may be reused as a whole
        if mtype == "counter":
            name += "_total"
        doc = fam.documentation
        if "\\" in doc or "\n" in doc:
            doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        append(f"# HELP {name} {doc}\n# TYPE {name} {_PROM_TYPES[mtype]}\n")
        created: list[str] = []
        created_name = fam.name + "_created"
        for s in samples:
            labels = s[1]
            sticky = type(s) is StickySample
            frozen = labels if type(labels) is FrozenLabels else None
            if sticky and frozen is not None:
                done = frozen.line
                if done is not None and done[0] is s:  # the very object rendered last time
                    append(done[1])
                    continue
            sname, v, ts = s[0], s[2], s[3]
            if frozen is not None and frozen.name == sname:
                p = frozen.prefix
            else:
                frozen = None
                p = get((sname, tuple(labels.items()))) or label_prefix(sname, labels)
            # Fast paths: a finite float below 1e6 prints as repr() in Go's format too, and so does an
            # int in that range once made a float ("3.0"); larger values need Go's exponent form.
            tv = type(v)
            if tv is float and -1e308 < v < 1e6:
                txt = repr(v)
            elif tv is int and -_EXACT < v < _EXACT:
                txt = f"{v}.0" if v < 1_000_000 else _big_int(v)
            elif tv is float and 1e6 <= v < 1e15 and v.is_integer():  # a byte or packet counter made a float
                txt = _big_int(v)
            else:
                txt = float_memo(v) or _float_memo(v)
            if ts is not None:
                txt += f" {int(float(ts) * 1000):d}"
                whole = False
            if sname == created_name:
                created.append(p + txt + "\n")
                whole = False
                continue
            line = p + txt + "\n"
            if not sticky:
                whole = False
            elif frozen is not None and ts is None:
                frozen.line = (s, line)
            append(line)
        if created:
            append(f"# HELP {fam.name}_created {doc}\n# TYPE {fam.name}_created gauge\n")
            out.extend(created)
        if whole:
            new_blocks[key] = (list(samples), "".join(out[start:]))
    with _BLOCKS_LOCK:  # keep only what this run saw: the cache never outgrows one exposition
        _BLOCKS.clear()
        _BLOCKS.update(new_blocks)
    return "".join(out).encode("utf-8")


def _float(v: float) -> str:
    """A sample value as Go formats it (as prometheus_client's floatToGoString)."""
    d = float(v)
    if d != d:
        return "NaN"
    if d == _INF:
        return "+Inf"
    if d == _NINF:
        return "-Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _big_int(v: float) -> str:
    """``_float(v)`` for an int in [1e6, 1e15): its digits are exactly float(v)'s shortest repr."""
    digits = str(int(v))
    mantissa = digits.rstrip("0")
    exp = _EXPONENTS[len(digits) - 1]
    return mantissa[0] + "." + mantissa[1:] + exp if len(mantissa) > 1 else mantissa + exp


#: "e+06" ... "e+15": the exponents _big_int writes.
_EXPONENTS = tuple(f"e+{e:02d}" for e in range(16))


#: Formatted large values (clocks in Hz, memory sizes, ...) repeat from scrape to scrape.
_FLOATS: dict[float, str] = {}


def _float_memo(v: float) -> str:
    txt = _float(v)
    if v == v:  # NaN never equals itself: not cacheable (and never hit)
        if len(_FLOATS) >= 4096:
            _FLOATS.clear()
        _FLOATS[v] = txt
    return txt


_INF, _NINF = float("inf"), float("-inf")
#: Integers below this magnitude are exact as floats and repr() without an exponent ("-123.0").
_EXACT = 10**15


class _Families:
    def __init__(self, families: Sequence[Metric]) -> None:
        self.families = families

    def collect(self) -> Sequence[Metric]:
        return self.families


#: (family name, type, doc, unit) -> (samples, rendered block) of the previous encode_openmetrics run: its own
#: cache, as its blocks differ from the text format's (its sample lines do not: FrozenLabels.line serves both).
_OM_BLOCKS: dict[tuple[str, str, str, str], tuple[list[Sample], str]] = {}
_OM_LOCK = threading.Lock()
_LEGACY_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
#: Family names known to need no escaping in OpenMetrics (legacy names without ':').
_PLAIN_NAMES: set[str] = set()


def _om_reference(families: Sequence[Metric], escaping: str) -> bytes:
    return bytes(om.generate_latest(_Families(families), escaping=escaping))  # type: ignore[no-untyped-call]


def encode_openmetrics(families: Sequence[Metric], escaping: str = om.UNDERSCORES) -> bytes:
    """OpenMetrics 1.0 text, byte-identical to prometheus_client's ``openmetrics.exposition.generate_latest``
    for ``escaping`` "underscores" or "allow-utf-8" (the same output for legacy names).

    ``# HELP``/``# TYPE`` (and ``# UNIT`` for a family with a unit) per family, counters named
    without ``_total`` and their samples with it, sample timestamps in seconds, ``# EOF`` at the end.
    """
    if escaping not in (om.UNDERSCORES, om.ALLOWUTF8):
        return _om_reference(families, escaping)
    with _OM_LOCK:
        blocks = dict(_OM_BLOCKS)
    new_blocks: dict[tuple[str, str, str, str], tuple[list[Sample], str]] = {}
    float_memo = _FLOATS.get
    out: list[str] = []
    append = out.append
    get = PREFIXES.get
    for fam in families:
        name, mtype, samples = fam.name, fam.type, fam.samples
        if name not in _PLAIN_NAMES:
            if not _LEGACY_NAME.match(name):  # needs escaping (or quoting): the reference does it
                return _om_reference(families, escaping)
            _PLAIN_NAMES.add(name)
        key = (name, mtype, fam.documentation, fam.unit)
        block = blocks.get(key)
        if block is not None and len(block[0]) == len(samples) and all(map(operator.is_, block[0], samples)):
            append(block[1])
            new_blocks[key] = block
            continue
        start = len(out)
        whole = True
        doc = fam.documentation
        if "\\" in doc or "\n" in doc or '"' in doc:
            doc = doc.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        append(f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n")
        if fam.unit:
            append(f"# UNIT {name} {fam.unit}\n")
        for s in samples:
            labels = s[1]
            sticky = type(s) is StickySample
            frozen = labels if type(labels) is FrozenLabels else None
            if sticky and frozen is not None:
                done = frozen.line
                if done is not None and done[0] is s:
                    append(done[1])
                    continue
            sname, v, ts = s[0], s[2], s[3]
            if s[4] is not None or s[5] is not None or ":" in sname:  # an exemplar, a native histogram
                return _om_reference(families, escaping)
            if frozen is not None and frozen.name == sname:
                p = frozen.prefix
            else:
                frozen = None
                p = get((sname, tuple(labels.items()))) or label_prefix(sname, labels)
            tv = type(v)  # the same fast paths as encode_text
            if tv is float and -1e308 < v < 1e6:
                txt = repr(v)
            elif tv is int and -_EXACT < v < _EXACT:
                txt = f"{v}.0" if v < 1_000_000 else _big_int(v)
            elif tv is float and 1e6 <= v < 1e15 and v.is_integer():  # a byte or packet counter made a float
                txt = _big_int(v)
            else:
                txt = float_memo(v) or _float_memo(v)
            if ts is not None:
                whole = False
                append(f"{p}{txt} {ts}\n")
                continue
            line = p + txt + "\n"
            if not sticky:
                whole = False
            elif frozen is not None:
                frozen.line = (s, line)
            append(line)
        if whole:
            new_blocks[key] = (list(samples), "".join(out[start:]))
    append("# EOF\n")
    with _OM_LOCK:
        _OM_BLOCKS.clear()
        _OM_BLOCKS.update(new_blocks)
    return "".join(out).encode("utf-8")


@dataclass(frozen=True)
class Format:
    """A negotiated exposition format: its ``Content-Type`` and the function that encodes families in it."""

    content_type: str
    encode: Callable[[Sequence[Metric]], bytes]
    #: "text", "openmetrics", or "reference" (an escaping scheme only prometheus_client implements)
    kind: str


TEXT = Format(CONTENT_TYPE_PLAIN_0_0_4, encode_text, "text")
_NEGOTIATED: dict[str, Format] = {}
_NEGOTIATED_MAX = 256


def negotiate(accept: str | None) -> Format:
    """The format an ``Accept`` header asks for, as prometheus_client's ``choose_encoder`` picks it
    (Prometheus text 0.0.4 when nothing else is asked for, or when the header cannot be understood)."""
    header = accept or ""
    fmt = _NEGOTIATED.get(header)
    if fmt is None:
        fmt = _negotiate(header)
        if len(_NEGOTIATED) >= _NEGOTIATED_MAX:
            _NEGOTIATED.clear()
        _NEGOTIATED[header] = fmt
    return fmt


def _negotiate(header: str) -> Format:
    try:
        encoder, content_type = choose_encoder(header)
    except Exception:  # e.g. "version=1.x" compares a str with an int: serve the default format
        return TEXT
    keywords = getattr(encoder, "keywords", None) or {}
    escaping = str(keywords.get("escaping", om.UNDERSCORES))
    func = getattr(encoder, "func", encoder)
    if content_type == CONTENT_TYPE_PLAIN_0_0_4:
        return TEXT
    if func is om.generate_latest and escaping in (om.UNDERSCORES, om.ALLOWUTF8):
        return Format(content_type, lambda fams: encode_openmetrics(fams, escaping), "openmetrics")
    if func is generate_latest and escaping != om.DOTS:  # the text format escapes legacy names only for "dots"
        return Format(content_type, encode_text, "text")

    def reference(families: Sequence[Metric]) -> bytes:
        return bytes(encoder(_Families(families)))

    return Format(content_type, reference, "reference")
