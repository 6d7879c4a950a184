"""`gradmesh simulate`: predicted step time, scaling efficiency and communication overhead of a
job on clusters larger than this one, from the cost formulas gradmesh runs on."""
