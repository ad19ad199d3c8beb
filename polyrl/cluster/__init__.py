"""The cluster and its workers: the role table, placement groups, the Ray session,
worker groups and light workers, residency on the GPUs, user code shipped to workers,
reactions to dead workers, and the cluster checks of `doctor`. Imports the core,
observe/, weight_sync/ and backends' registry."""
