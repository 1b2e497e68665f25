"""Helpers of ``benchmarks/cifar10_efficientnet.py``: the model, the optimizer and the data.

* :mod:`~benchmarks.cifar10.model`: EfficientNet-B0 for 32×32 inputs (``timm`` when it imports, else a
  plain-PyTorch re-implementation);
* :mod:`~benchmarks.cifar10.lamb`: LAMB (``timm.optim.Lamb`` when it imports, else a plain-PyTorch one);
* :mod:`~benchmarks.cifar10.data`: CIFAR-10 from the python-format batches (no torchvision), the optional
  download, a synthetic CIFAR-shaped data set, augmentation and normalisation on tensors.
"""
