"""What starts a job's ranks besides gradmesh's own launcher: Ray Train (`ray`), Spark's
TorchDistributor (`spark`); `choice` picks one by name."""
