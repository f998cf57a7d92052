"""The one error type the cluster tool raises for problems a user can fix; the CLI prints it on one line."""


class ClusterError(Exception):
    """A clear, actionable failure of the local cluster tool (bad input, busy port, missing tool, timeout)."""
