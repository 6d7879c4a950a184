"""A PyTorch training script whose model is split over ranks: tensor and/or pipeline parallel,
data parallel across the rest.

gradmesh run -np 4 -- python examples/model_parallel.py --tensor-parallel 2
gradmesh run -np 4 -- python examples/model_parallel.py --pipeline-parallel 2 --microbatches 4

Any layout of the same global batch takes the same steps: the printed losses match those of
`--tensor-parallel 1 --pipeline-parallel 1` (plain data parallelism) to float rounding.
"""

import argparse

import torch

import gradmesh
from gradmesh.data import DATASETS, DataOptions
from gradmesh.models.registry import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--tensor-parallel", type=int, default=1)
parser.add_argument("--pipeline-parallel", type=int, default=1)
parser.add_argument("--microbatches", type=int, default=1)
parser.add_argument("--schedule", default="1f1b")
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

rt = gradmesh.init(tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel)
replicas = gradmesh.mesh()["dp"]  # the ranks that hold the same part of the model as this one

data = DATASETS.get("synthetic")(DataOptions(shape=(3, 32, 32), classes=10, samples=1024))
torch.manual_seed(0)  # the whole model, the same on every rank, before it is split
model = build_model("alexnet", data)
layout = gradmesh.LayoutConfig(
    tensor_parallel=args.tensor_parallel,
    pipeline_parallel=args.pipeline_parallel,
    microbatches=args.microbatches,
    schedule=args.schedule,
)
# the recipe: tensor split, then the pipeline cut (balanced on the layers' measured times)
split = gradmesh.parallelize(model, layout, example=data.train.x[:1], name="alexnet")
optimizer = torch.optim.SGD(split.module.parameters(), lr=0.02, momentum=0.9)
gradmesh.broadcast_parameters(
    split.module.state_dict(), root_rank=replicas.rank_at(0), group=replicas.group
)
optimizer = gradmesh.DistributedOptimizer(
    optimizer,
    named_parameters=split.module.named_parameters(),
    backward_passes_per_step=split.engine.backward_passes,  # one backward per micro-batch
)

batch = 64
for step in range(args.steps):
    start = step * batch % (len(data.train) - batch)
    mine = torch.arange(start, start + batch).tensor_split(replicas.size)[replicas.index]
    optimizer.zero_grad()
    # the replica's summed loss, scaled so that averaging over replicas gives the batch mean
    loss = split.step(data.train.x[mine], data.train.y[mine], replicas.size / batch)
    optimizer.step()
    # every replica's loss, counted once: only the rank holding a replica's output adds it
    total = gradmesh.allreduce(loss * split.owns_output, op=gradmesh.Sum, name="loss")
    if rt.rank == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {float(total) / batch:.6f}", flush=True)
gradmesh.shutdown()
