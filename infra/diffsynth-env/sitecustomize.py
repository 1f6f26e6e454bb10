"""Side environment only: define torchvision's compiled op schemas so its Python part imports.

The CUDA torchvision wheel that matches torch 2.13 cannot load its ops next to a CPU torch
("operator torchvision::nms does not exist"). DiffSynth imports torchvision but needs only its
pure-Python transforms; defining the two schemas lets `import torchvision` succeed. Never install
this into the main environment (see docs/families/diffsynth.md).
"""

import torch.library

_LIB = torch.library.Library("torchvision", "DEF")
_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
