"""The one compatibility shim for torchtune 0.6.1 (unmaintained) on torchao 0.18.

torchtune 0.6.1 imports ``torchao.dtypes.nf4tensor`` (``NF4Tensor``, ``to_nf4``, ``linear_nf4``,
``implements``) from several modules at import time; torchao 0.18 moved that module to
``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``, so ``import torchtune`` fails with
``ModuleNotFoundError``. ``import_torchtune()`` registers the new module under the old name first.
qharness only uses torchtune's model builders (no NF4 / QLoRA).

``tests/test_torchtune.py::test_the_nf4_shim_is_still_needed`` fails once torchao ships the old path again
or torchtune stops importing it: then delete this module and import torchtune directly.

Example::

    torchtune = import_torchtune()
    from torchtune.models.llama3_2 import llama3_2
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

OLD = "torchao.dtypes.nf4tensor"
NEW = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def torchao_has_old_nf4_path() -> bool:
    """Whether torchao itself still ships ``torchao/dtypes/nf4tensor.py`` (ignores our alias in sys.modules)."""
    import torchao.dtypes

    return importlib.machinery.PathFinder.find_spec("nf4tensor", list(torchao.dtypes.__path__)) is not None


def torchtune_installed() -> bool:
    return importlib.util.find_spec("torchtune") is not None


def import_torchtune():
    """``import torchtune`` with ``torchao.dtypes.nf4tensor`` aliased to its torchao 0.18 home when missing."""
    from qharness.errors import UserError

    if not torchtune_installed():
        raise UserError("torchtune is not installed", fix='pip install "qharness[torchtune]" (torchtune==0.6.1)')
    if OLD not in sys.modules and not torchao_has_old_nf4_path():
        sys.modules[OLD] = importlib.import_module(NEW)
    import torchtune

    return torchtune
