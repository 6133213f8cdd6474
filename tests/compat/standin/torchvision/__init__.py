"""A stand-in for the few parts of torchvision that BytePS's PyTorch examples use, for running them on a
machine without torchvision (which has no build for this torch) and without internet
(tests/compat/examples.py puts this folder on the examples' PYTHONPATH; docs/compat.md).

* ``datasets.MNIST``: reads the IDX files torchvision itself reads (``<root>/MNIST/raw``); the harness
  writes small ones (tests/compat/standin/data.py); nothing is downloaded.
* ``transforms``: ``Compose``, ``ToTensor``, ``Normalize``.
* ``models.<name>(num_classes=...)``: any name gives one small convolutional network, not the named
  architecture: the examples' communication is what is tested, not torchvision's models.
"""
from . import datasets, models, transforms  # noqa: F401

__version__ = "0.0+byteps.standin"
