"""The XLA flags of every program the tests compile for the CPU, in this process and in the
`train.py` processes they start (tests/helpers/trainer.train_env).

LLVM at -O0: XLA optimises the program (fusion, collectives, layouts, buffer assignment) as
before, only the machine code it emits for the CPU is not optimised. The optimised HLO and the
memory analysis of the tiny train step are byte-for-byte the same (BASP, a ring, full remat;
jax 0.10.2), and compiling takes 35-40% less time: 170 -> 110 s for tests/models/test_parallel.py
and test_loss_chunked.py on 2 cores. The tests' programs are tiny, so running them unoptimised
costs nothing. The GPU programs of tests/e2e/test_gpu_compile.py are compiled without it (their
compile time does not change, and they must be what a user gets).

On jaxlib 0.10, XLA's CPU backend can still emit fusions with its older LLVM emitters
(--xla_cpu_use_fusion_emitters=false): a tiny BASP train step compiles in 30-40% less time (a
5-step run: 5.9 -> 3.8 s). Later jaxlibs have only the new emitters, and abort on the flag.

On those later jaxlibs the tests' tiny matmuls run on one thread each instead of Eigen's pool
(--xla_cpu_multi_thread_eigen=false): on 2 cores, whose threads the two pytest workers already
share, tests/train/test_layouts.py takes 49 s instead of 56, tests/models/test_parallel.py 37
instead of 39 (jaxlib 0.12; under 0.10 it makes no difference, and is left out).

jaxlib 0.10 and 0.11 hand some of the CPU program's reductions and matmuls to YNNPACK
(`__ynn_fusion`), whose kernels in those releases crash or hang on a worker thread for some shapes
(fixed upstream in XNNPACK; jax-ml/jax#39257, #40412). The tests' train steps run such fusions
(rank-5 softmax reductions with a size-1 dimension), and a CI pass under 0.10 once aborted on a
worker thread during such a step. That abort's cause is not known (6,000 repeats of the step
did not abort); these kernels are the known suspect. Under those jaxlibs the tests compile
without them (--xla_cpu_experimental_ynn_fusion_type=, empty: no YNNPACK fusions); their
programs run the same and their compile and run times do not change measurably.
"""

from importlib.metadata import version

import pytest


def jaxlib_minor() -> tuple[int, int]:
    """(major, minor) of the installed jaxlib, e.g. (0, 10)."""
    major, minor = version("jaxlib").split(".")[:2]
    return int(major), int(minor)


TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if jaxlib_minor() < (0, 11):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
else:
    TEST_XLA_FLAGS += " --xla_cpu_multi_thread_eigen=false"
if jaxlib_minor() < (0, 12):
    TEST_XLA_FLAGS += " --xla_cpu_experimental_ynn_fusion_type="


# CI runs the suite under jaxlib 0.10 (Python 3.11) and the newest (Python 3.12), whose CPU
# compiler takes 1.8-2.5x as long for the same program (its MLIR fusion emitters: a tiny BASP
# attention forward and backward compiles in 0.3 s under 0.12, 0.12 s under 0.10). A
# parametrized equivalence matrix runs whole under the older jaxlib; under a newer one the
# cases marked with this skip, and the rest still run there: its fast-tier cases, its BASP
# case where it spans layouts, and what each test's comment names. The GPU-compile tier does
# the same (tests/e2e/test_gpu_compile.py: WHOLE_TIER).
WHOLE_MATRIX = pytest.mark.skipif(
    jaxlib_minor() >= (0, 11), reason="a further case of an equivalence matrix: the whole "
    "matrix runs under jaxlib < 0.11 (CI's Python 3.11 pass), its representative cases under "
    "every jaxlib")

# A test of processes or a script whose cost is mostly wall-clock waiting and process start-up,
# and whose code under test is ours, not the jaxlib's (peers started 45 s apart, a frozen peer's
# 10 s of silence, two processes stopped by one signal; the GPU check's whole smoke run, which
# CI's GPU-check pass also runs under the GPU machine's jax): once per CI, in the older
# jaxlib's pass, to keep both passes under 30 minutes.
ONE_PASS = pytest.mark.skipif(
    jaxlib_minor() >= (0, 11), reason="runs once per CI, under jaxlib < 0.11 (CI's Python 3.11 "
    "pass): its cost is waiting and process start-up, and the code it tests is ours")
