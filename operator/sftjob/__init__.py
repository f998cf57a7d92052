"""Contracts shared by the operator, the `sftjob` CLI and the trainer.

Nothing in this package imports torch or kopf: it holds the SFTJob spec model, the GPU profile
table, the memory estimator and planner, the trainer configuration, and the exit codes and
failure classes that the trainer and the operator agree on.
"""
