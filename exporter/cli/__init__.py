"""The command-line tools: the daemon's command, top and profile."""
