"""What every gpufleet daemon and command line shares: HTTP(S) server, web config, systemd notify, logging, value types, files.

The agent, the detector and the simulator import it; it imports only :mod:`gpufleet.vocab`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version (pyproject.toml's, through the package metadata): every
    #: daemon's --version, the agent's build info metric and its Server header say this.
    __version__ = version("gpufleet")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
