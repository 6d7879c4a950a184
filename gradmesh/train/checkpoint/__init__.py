"""Step checkpoints of every piece of a run's state, written atomically, loaded without pickle.

A checkpoint is a folder `DIR/step-NNNNNNNN/` holding one file per rank (`rank-RRRRR.pt`: that
rank's model part, optimizer state, strategy state such as compressor residuals and local SGD's
counters, RNG state, its partial epoch loss) and `meta.json`, written last by rank 0 (in a
parameter-server job: the first worker; the servers write their shards as ranks 0..S-1) once
every rank's file is in place: the position (step, epoch, step within it), the loss history, the
run's identity, the world and the files. Without `meta.json` a folder is never chosen, so a
job killed mid-write resumes from the previous complete checkpoint. Each file is written to a
temporary name, flushed to disk and renamed. The newest `keep` complete checkpoints are kept.

Rank files load with `torch.load(weights_only=True)`, the metadata is JSON: nothing a
checkpoint holds can run code. We do not use torch.distributed.checkpoint for this: its
FileSystemReader reads `.metadata` with `pickle.load` (torch 2.13), which would run whatever
a crafted file holds. Its idea of an asynchronous save is kept: `asynchronous=True` copies the
state on the training thread (the stall) and writes it on a background thread.

The folder must be visible to every rank (one host, or a shared filesystem): rank 0 waits for
the other ranks' files there before it writes the metadata.
"""

from gradmesh.train.checkpoint import files, reshard, writer
from gradmesh.train.checkpoint.files import *  # noqa: F403
from gradmesh.train.checkpoint.reshard import *  # noqa: F403
from gradmesh.train.checkpoint.writer import *  # noqa: F403

__all__ = [*files.__all__, *reshard.__all__, *writer.__all__]
