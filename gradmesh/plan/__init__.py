"""`gradmesh plan`: profile a model, price every placement per layer on the job's links, and
write the plan with the fastest predicted step."""
