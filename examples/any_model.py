"""Your own model, made tensor-, pipeline- and data-parallel by a few lines added to a plain
PyTorch loop. The model is defined here, in plain PyTorch (nothing of gradmesh in it): a small
GPT in nanoGPT's shape (a fused q/k/v projection `c_attn`, attributes `n_head` and `n_embd`,
an output head tied to the token embedding), trained on bytes of text.

gradmesh run -np 4 -- python examples/any_model.py --tensor-parallel 2     # dp 2 x tp 2
gradmesh run -np 4 -- python examples/any_model.py --pipeline-parallel 2   # dp 2 x pp 2
gradmesh run -np 4 -- python examples/any_model.py --tensor-parallel 2 --pipeline-parallel 2
gradmesh run -np 2 -- python examples/any_model.py                         # dp 2

Every layout takes the same steps on the same global batches: the printed losses agree to float
rounding (docs/your_model.md).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import gradmesh
from gradmesh.data.text import corpus


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.n_embd))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, seq: int = 32, n_embd: int = 64, n_head: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(seq, n_embd)
        nn.init.normal_(self.wte.weight, std=0.02)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(4))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# the plan: module names (wildcards allowed) -> how each is split over the tensor-parallel ranks
PLAN = {
    "wte": "embedding",  # vocabulary rows; the tied lm_head gets the same rows
    "h.*.attn": "heads(n_head,n_embd)",  # each rank's attention holds n_head/tp heads
    "h.*.attn.c_attn": "colwise(1,1,1)",  # q, k and v split each, so heads are whole
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.0": "colwise",
    "h.*.mlp.2": "rowwise",
    "lm_head": "colwise(gather)",
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, the mean over every position of the batch (as torch's losses return)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


parser = argparse.ArgumentParser()
parser.add_argument("--tensor-parallel", type=int, default=1)
parser.add_argument("--pipeline-parallel", type=int, default=1)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

gradmesh.init(tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel)
replicas = gradmesh.mesh()["dp"]
torch.manual_seed(0)  # the same whole model on every rank, before it is split
model = TinyGPT()
data = torch.frombuffer(bytearray(corpus()[: 64 * 33 * args.steps]), dtype=torch.uint8).long()
batches = data.view(args.steps, 64, 33)  # 64 sequences of 32 bytes (+ the next byte) a step

model = gradmesh.parallelize(model, PLAN)  # tp 1 leaves the model whole
step_fn, passes = None, 1  # backward calls per step (a pipeline stage: one per micro-batch)
if args.pipeline_parallel > 1:  # then cut at h.2 on the graph; 4 micro-batches, 1F1B
    stage = gradmesh.pipeline_stage(model, batches[0, :32, :-1], ["h.2"], 4, "1f1b", lm_loss)
    model, step_fn, passes = stage.stage_module, stage.step, stage.backward_passes
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
optimizer = gradmesh.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    backward_passes_per_step=passes,
)

for step in range(args.steps):
    x, y = batches[step, :, :-1], batches[step, :, 1:]
    x, y = (
        x.tensor_split(replicas.size)[replicas.index],
        y.tensor_split(replicas.size)[replicas.index],
    )
    optimizer.zero_grad()
    if step_fn is not None:
        loss = step_fn(x, y, 1.0 / len(y))
    else:
        loss = lm_loss(model(x), y)
        loss.backward()
        loss = loss * len(y)  # summed over the samples, as the stage's step returns it
    optimizer.step()
    total = gradmesh.allreduce(loss.detach().double().reshape(1), op=gradmesh.Sum)
    if gradmesh.rank() == 0 and step % 10 == 9:
        # the sum over ranks counts each replica's loss once per rank holding it whole
        holders = args.tensor_parallel  # the last stage's tp ranks each hold the loss
        print(f"step {step + 1}: loss {float(total) / holders / 64:.4f}", flush=True)
