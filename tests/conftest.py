"""Test setup. Without a CUDA device the Triton kernels run under the interpreter on CPU tensors:
TRITON_INTERPRET must be set before triton is first imported, so it is set here, ahead of every
test module. (Processes spawned by tests/distributed.py set TRITON_INTERPRET=0 and run the pure-torch
references instead: see there.) GPU tests are marked `gpu` and skip cleanly where no CUDA device is present."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def references():
    """The test runs moe_fp4's pure-torch reference conversions instead of the Triton kernels under the
    interpreter (helpers.torch_references): for tests of the layer or the hook, not of the kernels."""
    from helpers import torch_references

    with torch_references():
        yield
