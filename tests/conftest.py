"""Test setup: 8 virtual CPU devices, set before JAX is imported."""
import os

# XLA:CPU's concurrency-optimized scheduler stays on (the default users get): with it, a
# backward pass that all-reduced inside two loops at once crashed XLA's in-process
# all-reduce (flax's SST-2 bidirectional LSTM; README "Porting from pmap"). hoist-collectives
# now takes those all-reduces out of the loops, and tests/clients/test_flax_sst2.py runs
# under the default scheduler to show it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's machine code at LLVM's -O0 (RT_TEST_XLA_OPT=1: its default): the tests check
# the HLO we give XLA and that its results equal jax.jit's of the same step, compiled in
# the same process the same way; LLVM's optimisations (without fast math, which XLA:CPU
# leaves off) change how fast the code runs, not what it computes, and were about half
# of the suite's time. The HLO passes (fusion, the scheduler above, collectives) are
# unchanged. Benchmarks and users get XLA's default.
if os.environ.get("JAX_PLATFORMS") == "cpu" and os.environ.get("RT_TEST_XLA_OPT", "0") == "0" \
        and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# TPU targets (tests/test_tpu.py) compile offline: libtpu must not ask the cloud metadata
# server anything, nor lock out the other pytest workers
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# the verifier runs after every pass in every test (production verifies the pipeline's
# result once and re-runs the passes only to name one that broke the graph)
os.environ.setdefault("RT_VERIFY", "each")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
assert len(jax.devices()) >= 8, "tests need 8 virtual CPU devices (XLA_FLAGS set too late?)"


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="long modes: the semantics fuzzer runs 1000 random programs, the "
                          "semantics corpus its whole matrix, every client port both "
                          "replica counts, the cut-dim tests all their size sets")
