"""Sync: how the replicas of a model agree. Synchronous data parallelism (`data_parallel`),
parameter servers (`parameter_server`), local SGD (`local_sgd`), Hogwild! (`hogwild`). A
strategy never imports another; what they share (`wrapping`) sits here beside them."""
