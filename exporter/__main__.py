"""`python -m exporter`: the same as the `gputrain-exporter` command."""

import sys

from exporter.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
