"""Test session setup.

Eight fake CPU devices are requested before JAX is imported anywhere, so the
sharding tests can build real meshes on a CPU-only machine. Single-device
tests are unaffected (they use the default device).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
