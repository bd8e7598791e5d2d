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
                     help="long modes: the semantics fuzzer runs 1000 random programs")
