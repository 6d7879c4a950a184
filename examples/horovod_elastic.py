"""An elastic Horovod script: the state lives in `hvd.elastic.TorchState`, is committed every
few batches, and the loop runs under `@hvd.elastic.run` with an `ElasticSampler`. Only its import
line differs from a Horovod script. gradmesh syncs, commits and restores the state as Horovod
does; a lost worker ends the job with one line (recovery needs gradmesh's automatic restart,
issue 15), after restoring the last commit.

gradmesh run -np 2 -- python examples/horovod_elastic.py
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradmesh.horovod as hvd  # was: import horovod.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())  # different on purpose: the state's sync gives every rank rank 0's

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
test, train = order[:360], order[360:]
dataset = torch.utils.data.TensorDataset(x[train], y[train])

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
BATCHES_PER_COMMIT = 10


@hvd.elastic.run
def train_epochs(state, epochs):
    for state.epoch in range(state.epoch, epochs):  # noqa: B020 - Horovod's own idiom
        sampler.set_epoch(state.epoch)
        for state.batch, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            sampler.record_batch(state.batch, 32)
            if state.batch % BATCHES_PER_COMMIT == 0:
                state.commit()
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0, sampler=sampler)
train_epochs(state, 8)

with torch.no_grad():
    accuracy = (model(x[test]).argmax(1) == y[test]).float().mean()
accuracy = hvd.allreduce(accuracy)
if hvd.rank() == 0:
    print(f"epochs {state.epoch + 1}, test accuracy {accuracy.item():.4f} on {hvd.size()} workers")
hvd.shutdown()
