"""Entry point: ``python -m sftjob_operator``."""

from sftjob_operator.main import main

main()
