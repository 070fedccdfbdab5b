"""What a run tells: metrics.jsonl and the progress line (metrics), TensorBoard and W&B
(writers), profiler traces (profiling), held-out evaluation (evaluate) and the log of a run's
start, steps and end (report)."""
