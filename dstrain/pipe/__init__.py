"""Pipeline parallelism: PipelineModule / LayerSpec, the 1F1B schedule, p2p, train_batch / eval_batch."""
