"""Check one GPU in under 7 minutes: what the planner and the kernels need to know of it.

In order (a run cut short keeps the sections that finished: the JSON is rewritten after each
case):

- train: the trainer's compiled step of a Llama-3.2-1B-shaped model at 16K tokens, a few steps:
  time, tokens/s, MFU, peak memory against the compiled prediction, and a jax.profiler trace of
  two more steps summarised (device time by kind of work, the top operations: profiling.py);
- checkpoint: the step after an asynchronous save with the trainer's Checkpointer, against the
  median step, with the state saved itself and from a copy on the device (the train loop's
  checkpoint.copy_on_device);
- kernels: every attention kernel (xla, cudnn, pallas, blockwise) against a float32 reference,
  output and the three input gradients, at head_dim 128 and 256, unpacked and packed (4 and 64
  documents), bf16 and fp16; ring: a ring of 2 hops (basp_jax/ring.py's hop kernels) likewise;
- timing: forward + backward attention per kernel at 16K tokens, head_dim 64 and 128, unpacked
  and packed, with JAX's own Pallas flash attention beside ours (64K tokens near the end);
- gemm: the 1B's and the 8B's projections and LM head at 16K tokens, forward and both backward
  GEMMs, achieved TFLOP/s per shape;
- experts: a mixture of experts' grouped matmuls, our Pallas kernels and XLA's ragged_dot, at
  Qwen3-30B-A3B's shapes on one GPU of a BASP group of 8, checked and timed;
- train_8b: 2 layers of Llama-3.1-8B's shape at 16K tokens, timed and profiled;
- train_fp8: the 1B steps with FP8 projections on sm89+ and the FP8 GEMMs in their program;
- calibration: benchmarks/calibrate.py's fit of the results above, a candidate for the planner.

    python -m benchmarks.gpu_check --out gpu_check.json          # on a GPU (scripts/gpu_check.sh)
    python -m benchmarks.gpu_check --cpu-smoke --out smoke.json  # the same code on the CPU with
                                                                 # tiny shapes (tests)

--cpu-smoke is the only way to run without a GPU: it shrinks every shape and skips what only a
GPU has (the cuDNN kernel, float16, device memory statistics), and says so in the output and the
JSON. Without it and without a GPU the check stops at once. What a kernel cannot run, and what
would not finish inside --budget-s, is skipped with the reason. Exit status: 0 when every check
ran and passed, 1 when one failed (the JSON's "failed" says which), 2 on bad input.
"""
