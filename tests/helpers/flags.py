"""The XLA flags of every program the tests compile for the CPU, in this process and in the
`train.py` processes they start (tests/helpers/trainer.train_env).

LLVM at -O0: XLA optimises the program (fusion, collectives, layouts, buffer assignment) as
before, only the machine code it emits for the CPU is not optimised. The optimised HLO and the
memory analysis of the tiny train step are byte-for-byte the same (BASP, a ring, full remat;
jax 0.10.2), and compiling takes 35-40% less time: 170 -> 110 s for tests/models/test_parallel.py
and test_loss_chunked.py on 2 cores. The tests' programs are tiny, so running them unoptimised
costs nothing. The GPU programs of tests/e2e/test_gpu_compile.py are compiled without it (their
compile time does not change, and they must be what a user gets).
"""

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
