"""Importing our Triton kernels under Triton's CPU interpreter, for the kernel tests.

TRITON_INTERPRET=1 must be set before a kernel module is imported (the test
modules set it first thing). `interpreted(name)` imports `services.model.<name>`
with a fix for numpy >= 2.4: it refuses int() of a 1-element array, which
triton 3.6's interpreter does for loop bounds read from memory
(triton-lang/triton#9171, fixed upstream by #9172 the same way). Skips the
test where triton is not installed.

`exact_fp8_rounding()` makes the interpreter's fp32 -> float8_e4m3fn conversions
go through torch: the interpreter's own rounds wrongly where the rounding carries
into an odd exponent (124.4 becomes 64, not 128; docs/internals.md).
"""

import contextlib
import importlib

import numpy as np
import pytest
import torch


def _needs_index_fix() -> bool:
    try:
        int(np.ones(1))
    except TypeError:
        return True
    return False


@contextlib.contextmanager
def index_fix():
    """Within: the interpreter with the numpy >= 2.4 fix (see the module docstring)."""
    pytest.importorskip("triton")
    import triton.runtime.interpreter as interpreter

    with pytest.MonkeyPatch.context() as patch:
        if _needs_index_fix():
            original = interpreter._patch_lang_tensor

            def patch_lang_tensor(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

            patch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        yield


@contextlib.contextmanager
def interpreted(module_name: str):
    """Yields services.model.<module_name> (e.g. "kernels.moe_ep") imported under the (fixed) interpreter."""
    with index_fix():
        yield importlib.import_module(f"services.model.{module_name}")


def interpreted_fixture(module_name: str):
    """A module-scoped fixture of interpreted(module_name)'s module, named as the test module's
    attribute it is assigned to (`norm = interpreted_fixture("kernels.norm")`)."""

    @pytest.fixture(scope="module")
    def fixture():
        with interpreted(module_name) as module:
            yield module

    return fixture


@contextlib.contextmanager
def exact_fp8_rounding():
    """fp32 -> float8_e4m3fn in the interpreter through torch (see the module docstring)."""
    pytest.importorskip("triton")
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter._convert_float

    def convert(values, src_type, dst_type, rounding_mode):
        if dst_type == tl.float8e4nv and src_type == tl.float32:
            return torch.from_numpy(np.ascontiguousarray(values)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(values, src_type, dst_type, rounding_mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", convert)
        yield
