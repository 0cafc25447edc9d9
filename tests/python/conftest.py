"""pytest setup for streamsafe's PyTorch integration (docs/pytorch.md).

The tests need torch with a GPU and the built package (pip install --no-build-isolation . , or
PYTHONPATH=allocator/python with STREAMSAFE_TORCH_EXT_LIB / STREAMSAFE_TORCH_LIB pointing at the
built libraries); without them every test is skipped with the reason. The test process installs
the extension once, before any CUDA allocation, with STREAMSAFE_TEST_CONF (default
"backend:expandable"); tests of other configurations run in child processes.
"""

import os
import subprocess
import sys

import pytest

try:
    import torch
except ImportError:  # pragma: no cover - CI without torch
    torch = None

REASON = None
if torch is None:
    REASON = "torch is not installed"
elif not torch.cuda.is_available():
    REASON = "no CUDA GPU"


def pytest_collection_modifyitems(config, items):
    if REASON:
        skip = pytest.mark.skip(reason=f"streamsafe PyTorch tests skipped: {REASON}")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ss():
    import streamsafe.torch as sst
    sst.install(os.environ.get("STREAMSAFE_TEST_CONF", "backend:expandable"))
    assert sst.installed() == "extension"
    return sst


def run_child(code, env=None, timeout=300):
    """Runs `code` in a fresh interpreter (same sys.path); returns (rc, stdout+stderr)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    e.pop("STREAMSAFE_TORCH_INSTALL", None)
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr
