"""`gradmesh simulate`: predicted step time, scaling efficiency, communication overhead and
memory of a job on 8 to thousands of GPUs, from the cost formulas gradmesh runs on (one source
of truth); docs/simulator.md is the long form.

**Model.** The model is built on torch's meta device (a trillion parameters cost no memory) and
run forward and backward under torch's FLOP counter and `KernelCounter`, which give every layer
with weights its FLOPs, parameter bytes and kernels (kind, FLOPs, bytes), in the order forward
runs them.

**Compute** is a roofline per kind of kernel (`devices.py`: convolutions, 3x3 ones, matrix
products, attention, memory-bound work), its achieved fractions fitted on the calibration rows of
`published.toml` alone (`published.py`; `--tflops`, `--achieved` override), or for `cpu` the
rate measured by running the model on this machine.

**Communication** comes from the collectives' registered formulas through the planner's `Links`
(`Links.allreduce_s`): two levels, within a node and across nodes, each a fabric preset
(`fabrics.py`) or a bare link (alpha = latency, beta = 1 / bandwidth); a flat algorithm that
spans nodes is priced on the across-node terms (its slowest link), `hierarchical` as its two
levels.

**Strategies** (`STRATEGIES`):
- `allreduce`: the planner's `predict` with every layer data-parallel: forward, then backward
  layer by layer in reverse, each bucket of `--fusion-mb` leaving when its last gradient is
  ready and the buckets sharing one link in order; overlap is simulated, not assumed.
- `ps`: `gradmesh.sync.parameter_server.cost.step_time` (mean-value analysis of W workers pushing
  and pulling through S servers) on the same alpha-beta terms; the G GPUs of a node share its
  link.
- `local-sgd`: compute every step, the parameters' allreduce every `--sync-every` steps.
- `tensor`: the model's own tensor-parallel plan within groups of `--tensor-parallel` GPUs (a
  node's by default), data parallelism across groups; `hybrid`: the planner's choice per layer
  (`gradmesh.planner.plan`, its exact search), both priced by the planner's `predict`
  on a profile whose seconds are each layer's roofline (`layout_profile`).
- `pipeline`: gradmesh's own pipeline schedule, action by action (`_pipeline`).

**Token models** (`mesh.py`, `mesh_command.py`) are priced on the mesh planner's own time and
memory formulas (`predict_mesh`, `predict_memory`) on a profile counted on the meta device, under
any dp x tp x pp x cp x ep layout with ZeRO and recomputation, or the fastest that fits
(`--search`).
`--validate` prices the published rows (`published.py`).

Efficiency at n GPUs is T(1) / T(n), T(1) one GPU's step with no communication (weak scaling:
each GPU keeps its batch); the overhead is T(n) - T(1) (the lectures' definitions).
"""
