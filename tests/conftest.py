"""Test setup: 8 virtual CPU devices, set before JAX is imported."""
import os

# XLA:CPU's concurrency-optimized scheduler runs independent loops at the same time; a step
# whose backward pass has an all-reduce inside two such loops (a bidirectional LSTM: the
# transpose of each scan's use of mirrored weights is a psum inside the loop) then crashes
# in XLA's in-process all-reduce (SIGSEGV in xla::cpu::ReduceScatter, jax 0.10.2 and
# 0.11.2; the same step under plain jax.shard_map crashes the same way). Off, it runs:
# tests/clients/test_flax_sst2.py, README "Porting from pmap".
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
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
