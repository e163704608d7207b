"""What every gpufleet daemon and command line shares: HTTP(S) server, web config, systemd notify, logging, value types, files."""
