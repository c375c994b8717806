"""fusetrain: fast mixed-precision, data-parallel PyTorch training.

Swap ``torch.amp.GradScaler`` for ``fusetrain.amp.GradScaler`` (one import);
choose a precision with ``fusetrain.amp.Policy``.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from ._compat import check_torch_build

check_torch_build()  # a torch other than the one _C was built for: ImportError, not a crash

from . import _C  # noqa: E402
from . import amp, graph, optim, parallel, utils
from ._devices import devices, tpu_available
from .graph import fuse_steps
from . import nn

__version__ = _C.version()

__all__ = ["amp", "devices", "fuse_steps", "graph", "nn", "optim", "parallel", "tpu_available", "utils", "__version__"]
