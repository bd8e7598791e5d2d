"""Test setup: 8 virtual CPU devices, set before JAX is imported."""
import os

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
