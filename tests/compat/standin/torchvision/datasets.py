"""``MNIST`` over the IDX files in ``<root>/MNIST/raw`` (torchvision's layout and format)."""
import os

import numpy as np
import torch

_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path):
    """An IDX file as a numpy array (big-endian header: 0, 0, dtype code 0x08 = uint8, rank, dims)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    rank = data[3]
    dims = np.frombuffer(data, dtype=">i4", count=rank, offset=4)
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        raw = os.path.join(os.path.expanduser(root), "MNIST", "raw")
        images, labels = (os.path.join(raw, name) for name in _FILES[bool(train)])
        if not (os.path.exists(images) and os.path.exists(labels)):
            raise RuntimeError(f"stand-in torchvision: no MNIST IDX files in {raw} (this stand-in never downloads; "
                               "tests/compat/standin/data.py writes them)")
        self.data, self.targets = read_idx(images), read_idx(labels).astype(np.int64)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        image, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
