"""Data sets as ``TensorDataset`` of ``(inputs, targets)``, read from local files, never downloaded.

* :func:`load_digits`: scikit-learn's bundled 8x8 digits (1 797 images, no download at all), or
  the same ``digits.csv.gz`` file from a folder of your own.
* :func:`load_mnist`, :func:`load_fashion_mnist`: the IDX files of MNIST and Fashion-MNIST
  (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``, each optionally ``.gz``-compressed).
* :func:`load_cifar10`: the *binary version* of CIFAR-10 (``cifar-10-batches-bin/data_batch_1.bin``
  to ``data_batch_5.bin`` and ``test_batch.bin``; each record is one label byte followed by the
  3 072 bytes of a 32x32 image, channel by channel).
* :func:`load_cifar100`: the binary version of CIFAR-100 (``cifar-100-binary/train.bin`` and
  ``test.bin``; each record is a coarse label byte, a fine label byte and the 3 072 image bytes),
  with the 100 fine or the 20 coarse labels.
* :func:`load_image_folder`: a folder of PNG or JPEG images, one sub-folder per class (needs
  Pillow, the ``images`` extra).
* :func:`load_tiny_imagenet`: Tiny-ImageNet's own folder layout (``wnids.txt``, ``words.txt``,
  ``train/<wnid>/images/*.JPEG``, ``val/images`` with ``val/val_annotations.txt``; Pillow).

The package's modules: :mod:`~renate_events.datasets.readers` (the binary formats, plain file
reading) and :mod:`~renate_events.datasets.images` (image files, with Pillow).

The readers are written here with plain file reading (``struct`` and ``torch.frombuffer``):
torchvision cannot be installed beside the torch build this project pins, and the "python version"
of CIFAR-10 is a serialized Python object file that this package will not load, so only the binary
version is supported. Nothing here downloads: a missing file raises :class:`FileNotFoundError`
naming the path that was expected and where to get the files. Headers and sizes are checked and a
corrupt file raises :class:`ValueError` naming it.

Inputs are ``float32`` in ``[0, 1]`` (the CIFAR readers keep the raw ``uint8`` bytes with
``dtype=torch.uint8``, a quarter of the memory; :func:`load_image_folder` always does); targets
are ``int64``. :func:`load_digits` returns flat
``(N, 64)`` inputs by default (the data set is distributed as 64 features); the image readers
return ``(N, C, H, W)`` images by default. Every loader takes ``flatten`` to choose, and
:func:`reshape_inputs` converts afterwards.

Example:
    >>> from renate_events.datasets import load_digits, reshape_inputs
    >>> digits = load_digits()
    >>> reshape_inputs(digits, (1, 8, 8)).tensors[0].shape
    torch.Size([1797, 1, 8, 8])
"""

from __future__ import annotations

from renate_events.datasets.images import (
    ImageFolderDataset,
    load_image_folder,
    load_tiny_imagenet,
)
from renate_events.datasets.readers import (
    load_cifar10,
    load_cifar100,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    reshape_inputs,
)

__all__ = [
    "ImageFolderDataset",
    "load_cifar10",
    "load_cifar100",
    "load_digits",
    "load_fashion_mnist",
    "load_image_folder",
    "load_mnist",
    "load_tiny_imagenet",
    "reshape_inputs",
]
