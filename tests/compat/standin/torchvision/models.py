"""Every model name (``resnet50``, ``vgg16``, ...) builds the same small network for 3-channel images."""
from torch import nn


def _small_net(num_classes=1000, **_unused):
    return nn.Sequential(nn.Conv2d(3, 8, kernel_size=3, stride=4), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


def __getattr__(name):
    if name.startswith("_"):
        raise AttributeError(name)
    return _small_net
