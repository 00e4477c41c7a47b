"""The Triton set-up of the Triton codegen tests: on a GPU the kernels run there; without one in Triton's
interpreter (TRITON_INTERPRET=1, numpy on the CPU), which Triton reads when it is imported."""
import os
import sys

import pytest
import torch


def import_triton():
    """(cuda, device, the triton module), TRITON_INTERPRET=1 set first where there is no GPU; skips the calling
    test module where triton is missing or was imported without the interpreter in this process."""
    cuda = torch.cuda.is_available()
    if not cuda:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 could be set in this process",
                        allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    triton = pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    return cuda, "cuda" if cuda else "cpu", triton
