"""The runtime: this process's place in the job (`world`), the job's ranks as a mesh of named
axes with one group each (`mesh`), and what the launcher told the process (`process`, no torch).
Knows nothing of algorithms, models or optimizers."""
