"""One element's text in ``nvidia-smi -q -x`` output, None where nvidia-smi writes that it has no value."""

from __future__ import annotations

import xml.etree.ElementTree as ET

#: What nvidia-smi writes for a value it does not have (N/A on drivers and GPUs without it, the rest on errors).
NA = ("", "N/A", "[N/A]", "Unknown Error", "Not Supported")


def text(el: ET.Element, path: str) -> str | None:
    """The stripped text at ``path`` under ``el``; None when absent or one of :data:`NA`."""
    node = el.find(path)
    if node is None or node.text is None:
        return None
    t = node.text.strip()
    return None if t in NA else t
