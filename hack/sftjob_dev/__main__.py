"""`python -m sftjob_dev up|down|status|env|nodes`: the local cluster tool."""

import sys

from sftjob_dev.cli import main

sys.exit(main())
