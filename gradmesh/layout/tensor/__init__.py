"""Tensor parallelism on the mesh's tp axis: the split layers and their exchanges
(`layers.py`), plans by module name (`plan.py`), the embedding and loss split by vocabulary
(`vocab.py`), the sequence split between the split layers (`sequence.py`), and placements per
layer that use the tp ranks as a data-parallel group for some layers (`hybrid.py`)."""
