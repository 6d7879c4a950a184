"""A Horovod script with process sets and grouped allreduce; only its import line differs.

Two process sets train two different models side by side (an ensemble): the even ranks a wide
network, the odd ranks a deep one, each set averaging its own gradients. Grouped allreduce
averages each set's metrics in one operation; the whole job then compares the two.

gradmesh run -np 2 -- python examples/horovod_process_sets.py   (2 ranks or more)
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradmesh.horovod as hvd  # was: import horovod.torch as hvd

hvd.init(process_sets="dynamic")
even = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
odd = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 1])
mine = even if hvd.rank() % 2 == 0 else odd
torch.manual_seed(0)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
test, train = order[:360], order[360:]

if mine is even:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
else:
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mine.size(), momentum=0.9)
# start the set's replicas alike: the root is a global rank of the set, as in Horovod
for p in model.state_dict().values():
    p.copy_(hvd.broadcast(p, root_rank=mine.ranks[0], process_set=mine))
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), process_set=mine
)

for _epoch in range(8):
    shard = train[mine.rank() :: mine.size()]
    for start in range(0, len(shard), 32):
        idx = shard[start : start + 32]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()

with torch.no_grad():
    logits = model(x[test])
    accuracy = (logits.argmax(1) == y[test]).float().mean()
    test_loss = F.cross_entropy(logits, y[test])
# both metrics of the set averaged in one operation
accuracy, test_loss = hvd.grouped_allreduce([accuracy, test_loss], process_set=mine)
# every rank sees every set's result (summed over the job, one value per set)
per_set = torch.zeros(2)
if mine.rank() == 0:
    per_set[0 if mine is even else 1] = accuracy
per_set = hvd.allreduce(per_set, op=hvd.Sum)
if hvd.rank() == 0:
    print(f"wide (ranks {even.ranks}) test accuracy {per_set[0].item():.4f}")
    print(f"deep (ranks {odd.ranks}) test accuracy {per_set[1].item():.4f}")
hvd.shutdown()
