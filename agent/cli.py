"""``gpufleet-agent``: the per-node agent's command line.

Modes::

    gpufleet-agent [FLAGS]                      serve metrics over HTTP(S) (default; also `serve`)
    gpufleet-agent once [FLAGS]                 print the exposition once and exit
    gpufleet-agent textfile --directory DIR [--interval S] [FLAGS]
                                                write DIR/gpufleet.prom atomically for node_exporter's
                                                textfile collector (once with --interval 0, else every S s)
    gpufleet-agent record [RECORD OPTIONS]      record a trace of raw NVML/NIC readings (see `record --help`)

Flags, ``GPUFLEET_*`` environment variables and the TOML config file: :mod:`gpufleet.agent.settings`;
the modes: :mod:`gpufleet.agent.modes`. Invalid flags, environment values or config print one line
on stderr and exit with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gpufleet.agent import modes
from gpufleet.agent.settings import PROG, UsageError, record_index, resolve
from gpufleet.serving.logs import log_logfmt


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        i = record_index(args)
        settings = resolve(args if i is None else args[:i])
        log_logfmt(settings.config.log_level)
        if i is not None:
            return modes.record(settings.config, args[i + 1:])
        return modes.run(settings)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
