"""Side environment only: define torchvision's compiled op schemas so its Python part imports.

The CUDA torchvision wheel that matches torch 2.13 cannot load its ops next to a CPU torch
("operator torchvision::nms does not exist"). DiffSynth imports torchvision but needs only its
pure-Python transforms; defining the two schemas lets `import torchvision` succeed. The schemas
are defined when torchvision is first imported (a meta-path hook), not at interpreter start-up,
so a process that never imports torchvision (splitstage's launcher) does not import torch either.
Never install this into the main environment (see docs/families/diffsynth.md).
"""

import sys


class _DefineTorchvisionOps:
    """Before the first `import torchvision`, define its two op schemas; then step aside."""

    library = None  # kept alive: the definitions live as long as it does

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and self.library is None:
            import torch.library

            self.library = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                self.library.define(
                    f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
                )
        return None  # the usual finders import it


sys.meta_path.insert(0, _DefineTorchvisionOps())
