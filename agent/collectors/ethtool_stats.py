"""NIC driver statistics as ``ethtool -S`` shows them: name -> value pairs, and what they mean.

The live reader (:mod:`gpufleet.agent.collectors.ethtool`, the kernel's ``ETHTOOL_GSTATS``
ioctl through pyroute2) and :func:`parse_ethtool_s` (the text ``ethtool -S <if>`` prints: the
fixtures, the simulator's hosts) both yield ``(name, value)`` pairs; :func:`classify` is the one
path from a pair to a series, so a recorded output is checked exactly as a live read is.

Which counters (mlx5 names, from the kernel's ``Documentation/networking/device_drivers/
ethernet/mellanox/mlx5/counters.rst``):

- PFC pause frames per priority, ``rx_prio<N>_pause`` / ``tx_prio<N>_pause``, and the time the
  port was paused (``*_pause_duration``, microseconds); 802.3x global pause ``rx_pause_ctrl_phy`` /
  ``tx_pause_ctrl_phy`` (priority ``global``). Only priorities with PFC enabled have them.
- the device's pause-storm watermarks ``tx_pause_storm_warning_events`` / ``_error_events``.
- buffer and congestion drops: ``rx_discards_phy``, ``tx_discards_phy``, ``rx_out_of_buffer``,
  ``rx_prio<N>_discards``, ``rx_prio<N>_buf_discard``, ``rx_prio<N>_cong_discard``.
- physical-layer errors: ``rx_crc_errors_phy``, ``rx_symbol_err_phy``, ``rx_pcs_symbol_err_phy``,
  ``rx_corrected_bits_phy`` (FEC-corrected bits), ``link_down_events_phy``.

A counter the driver does not have yields no series (never a zero). With ``all_stats`` every
other statistic is kept too, by its name (unbounded: hundreds per mlx5 port, per channel).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["pause_frames", "pause_seconds", "storm", "discards", "phy_errors", "other"]

_PRIO_PAUSE = re.compile(r"^(rx|tx)_prio([0-7])_pause(_duration)?$")
_GLOBAL_PAUSE = re.compile(r"^(rx|tx)_pause_ctrl_phy$")
_GLOBAL_PAUSE_DURATION = re.compile(r"^(rx|tx)_global_pause_duration$")
_PRIO_DISCARD = re.compile(r"^rx_prio[0-7]_(discards|buf_discard|cong_discard)$")
_STORM = {"tx_pause_storm_warning_events": "warning", "tx_pause_storm_error_events": "error"}
DISCARDS = frozenset({"rx_discards_phy", "tx_discards_phy", "rx_out_of_buffer"})
PHY_ERRORS = frozenset({"rx_crc_errors_phy", "rx_symbol_err_phy", "rx_pcs_symbol_err_phy",
                        "rx_corrected_bits_phy", "link_down_events_phy"})
_DIRECTION = {"rx": "receive", "tx": "transmit"}
#: Longest statistic name the kernel passes (ETH_GSTRING_LEN, including the NUL).
GSTRING_LEN = 32
_MAX_TEXT = 4 << 20


class Malformed(ValueError):
    """Text that is not ``ethtool -S`` output."""


@dataclass(frozen=True, slots=True)
class Stat:
    """Where one pair goes: the family (``kind``) and its labels besides ``interface``."""

    kind: Kind
    labels: tuple[str, ...]
    divisor: float = 1.0  # to base units


def classify(name: str, all_stats: bool = False) -> Stat | None:
    """The series a statistic feeds, or None when it is not on the allowlist (and not ``all_stats``)."""
    m = _PRIO_PAUSE.match(name)
    if m:
        direction, prio, duration = _DIRECTION[m[1]], m[2], m[3]
        if duration:
            return Stat("pause_seconds", (prio, direction), 1e6)  # microseconds
        return Stat("pause_frames", (prio, direction))
    m = _GLOBAL_PAUSE.match(name)
    if m:
        return Stat("pause_frames", ("global", _DIRECTION[m[1]]))
    m = _GLOBAL_PAUSE_DURATION.match(name)
    if m:
        return Stat("pause_seconds", ("global", _DIRECTION[m[1]]), 1e6)
    level = _STORM.get(name)
    if level is not None:
        return Stat("storm", (level,))
    if name in DISCARDS or _PRIO_DISCARD.match(name):
        return Stat("discards", (name,))
    if name in PHY_ERRORS:
        return Stat("phy_errors", (name,))
    if all_stats:
        return Stat("other", (name,))
    return None


def parse_ethtool_s(text: str) -> list[tuple[str, int]]:
    """The ``(name, value)`` pairs of ``ethtool -S <if>`` output, in order.

    Accepts the header line (``NIC statistics:``) and blank lines; per-queue lines some drivers
    print as ``[3]: rx_bytes: 5`` keep their ``[3]: `` prefix in the name. Raises
    :class:`Malformed` for anything else: a line without ``name: value``, a value that is not a
    non-negative integer, a name longer than the kernel allows, a duplicate name.
    """
    if len(text) > _MAX_TEXT:
        raise Malformed(f"more than {_MAX_TEXT} characters")
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or (n == 1 and line.endswith("statistics:")):
            continue
        name, sep, value = line.rpartition(":")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value.isdigit() or not value.isascii():
            raise Malformed(f"line {n}: not 'name: value': {line[:60]!r}")
        if len(name) >= GSTRING_LEN + 8 or name in seen:  # "[NN]: " prefixes make room for 8 more
            raise Malformed(f"line {n}: bad or repeated name {name[:60]!r}")
        seen.add(name)
        out.append((name, int(value)))
    return out


def plan(names: Sequence[str], all_stats: bool = False) -> list[tuple[int, Stat]]:
    """Where each statistic of a driver's name list goes: ``(position, Stat)`` for those that feed a series.
    A driver's names repeat every read, so a collector computes this once per name list."""
    out = []
    for i, name in enumerate(names):
        st = classify(name, all_stats)
        if st is not None:
            out.append((i, st))
    return out


def select(pairs: Iterable[tuple[str, int]], all_stats: bool = False) -> Iterator[tuple[Stat, float]]:
    """The pairs that feed a series, with their values in base units."""
    pairs = list(pairs)
    for i, st in plan([n for n, _ in pairs], all_stats):
        yield st, base_value(st, pairs[i][1])


def base_value(st: Stat, value: int) -> float:
    return value / st.divisor if st.divisor != 1.0 else value
