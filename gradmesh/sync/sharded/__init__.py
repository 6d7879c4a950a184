"""Sharded data parallelism (ZeRO) on the mesh's data axis, one package for its three stages:
the optimizer's state (stage 1, `optimizer.py`: torch's `ZeroRedundancyOptimizer` over the dp
group, and what a checkpoint keeps of it), and the model's gradients and parameters (stages 2
and 3, `model.py`: torch's FSDP2, one unit per block). Its option is `--zero-stage`
(`gradmesh.sync.config.AllreduceConfig.zero_stage`), checked once (`check_stage`, beside it)."""
