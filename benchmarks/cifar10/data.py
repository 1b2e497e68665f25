"""CIFAR-10 without torchvision: the python-format batches, an optional download, a synthetic stand-in,
and augmentation/normalisation on tensors (on whatever device the batch is on).

Real data: the "CIFAR-10 python version" (https://www.cs.toronto.edu/~kriz/cifar.html), i.e. the folder
``cifar-10-batches-py`` with ``data_batch_1`` … ``data_batch_5`` and ``test_batch``, each a pickled dict with
``b"data"`` (N×3072 uint8: 1024 red, 1024 green, 1024 blue values, row-major 32×32) and ``b"labels"``.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import tarfile
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
#: Per-channel mean and standard deviation of the 50,000 training images (pixel values in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class DataMissing(RuntimeError):
    """The CIFAR-10 files are not where they were looked for (the message says what to do)."""


# ------------------------------------------------------------------------------------------------ real data
def find_batches_dir(data_dir: str | os.PathLike) -> Optional[Path]:
    """``data_dir`` itself or ``data_dir/cifar-10-batches-py``, whichever holds all six batch files."""
    root = Path(data_dir).expanduser()
    for candidate in (root, root / CIFAR10_FOLDER):
        if all((candidate / name).is_file() for name in TRAIN_FILES + (TEST_FILE,)):
            return candidate
    return None


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with open(path, "rb") as f:
        entry = pickle.load(f, encoding="bytes")
    data = entry[b"data"] if b"data" in entry else entry["data"]
    labels = entry[b"labels"] if b"labels" in entry else entry["labels"]
    x = torch.as_tensor(data, dtype=torch.uint8).reshape(-1, 3, 32, 32)
    y = torch.as_tensor(list(labels), dtype=torch.int64)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{path}: {x.shape[0]} images but {y.shape[0]} labels")
    return x, y


def load_cifar10(data_dir: str | os.PathLike) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((x_train, y_train), (x_test, y_test))``: uint8 ``(N, 3, 32, 32)`` images and int64 labels."""
    folder = find_batches_dir(data_dir)
    if folder is None:
        raise DataMissing(
            f"CIFAR-10 not found in {data_dir!s} (looked for {', '.join(TRAIN_FILES)} and {TEST_FILE}, there or in "
            f"{CIFAR10_FOLDER}/). Download the python version ({CIFAR10_URL}), extract it and pass "
            "--data-dir <folder>, or add --download, or run with --synthetic."
        )
    parts = [_read_batch(folder / name) for name in TRAIN_FILES]
    train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return train, _read_batch(folder / TEST_FILE)


def md5sum(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def download_cifar10(data_dir: str | os.PathLike, url: str = CIFAR10_URL, md5: str = CIFAR10_MD5,
                     timeout: float = 60.0) -> Path:
    """Download the tarball into ``data_dir``, check its md5, extract it; returns the batches folder.

    Raises :class:`DataMissing` with a clear message when the network or the checksum fails."""
    import urllib.error
    import urllib.request

    root = Path(data_dir).expanduser()
    found = find_batches_dir(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "cifar-10-python.tar.gz"
    if not archive.is_file() or md5sum(archive) != md5:
        partial = archive.with_suffix(".part")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
                while block := response.read(1 << 20):
                    out.write(block)
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            partial.unlink(missing_ok=True)
            raise DataMissing(
                f"could not download CIFAR-10 from {url} ({err}). This machine may have no internet access: "
                f"download cifar-10-python.tar.gz elsewhere (md5 {md5}), extract it, and pass --data-dir <folder>; "
                "or run with --synthetic."
            ) from err
        partial.replace(archive)
    digest = md5sum(archive)
    if digest != md5:
        raise DataMissing(f"{archive}: md5 {digest}, expected {md5} (corrupt or partial download); delete it and retry.")
    with tarfile.open(archive, "r:gz") as tar:
        try:
            tar.extractall(root, filter="data")  # Python ≥ 3.12 (and patched 3.8+): no paths outside root
        except TypeError:
            tar.extractall(root)
    found = find_batches_dir(root)
    if found is None:
        raise DataMissing(f"{archive} did not contain {CIFAR10_FOLDER}/ with the six batch files")
    return found


def write_cifar_batch(path: str | os.PathLike, images: torch.Tensor, labels: torch.Tensor, name: str = "batch") -> None:
    """Write ``images`` (uint8 ``(N, 3, 32, 32)``) and ``labels`` in the python-format batch layout (for tests
    and for saving the synthetic set)."""
    entry = {
        b"batch_label": name.encode(),
        b"labels": [int(v) for v in labels],
        b"data": images.reshape(images.shape[0], 3072).numpy(),
        b"filenames": [f"{name}_{i}.png".encode() for i in range(images.shape[0])],
    }
    with open(path, "wb") as f:
        pickle.dump(entry, f)


# ------------------------------------------------------------------------------------------------ synthetic
def synthetic_cifar10(
    n_train: int = 50_000, n_test: int = 10_000, *, seed: int = 0, noise: float = 1.5, max_shift: int = 31, mix: float = 0.8,
    colour: float = 1.0,
    num_classes: int = 10,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A learnable CIFAR-shaped data set (uint8 ``(N, 3, 32, 32)``, 10 balanced classes), fixed by ``seed``.

    Each class has a prototype: a sum of six random low-frequency 2-D cosines (0–3 cycles per image) per colour
    channel. An image is its class prototype with a random contrast (0.6–1.4), plus another class's prototype
    with a random weight in ``[0, mix]``, circularly translated by a random offset of up to ``max_shift`` pixels
    (31: anywhere, so a linear classifier on the pixels stays near chance, ~20%, while translation-invariant
    features such as those a conv net with global pooling can learn separate the classes, ~95%), plus a random
    per-channel brightness offset and white noise of standard deviation ``noise`` (in units of the prototypes'
    standard deviation). **Not CIFAR-10**: numbers from it say nothing about CIFAR-10 accuracy, only that the
    pipeline runs and learns.
    """
    gen = torch.Generator().manual_seed(seed)
    size = 32
    grid = torch.arange(size, dtype=torch.float32) / size
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    protos = torch.zeros(num_classes, 3, size, size)
    for c in range(num_classes):
        for ch in range(3):
            for _ in range(6):
                fy = int(torch.randint(0, 4, (), generator=gen))
                fx = int(torch.randint(-3, 4, (), generator=gen))
                phase = float(torch.rand((), generator=gen)) * 2 * math.pi
                amp = float(torch.rand((), generator=gen)) + 0.5
                protos[c, ch] += amp * torch.cos(2 * math.pi * (fy * yy + fx * xx) + phase)
    protos += colour * torch.randn(num_classes, 3, 1, 1, generator=gen)  # a class colour cast (overlapping)
    protos = (protos - protos.mean()) / protos.std()

    def make_chunk(labels: torch.Tensor) -> torch.Tensor:
        n = labels.shape[0]
        other = (labels + torch.randint(1, num_classes, (n,), generator=gen)) % num_classes
        contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=gen)
        weight = mix * torch.rand(n, 1, 1, 1, generator=gen)
        x = contrast * protos[labels] + weight * protos[other]
        # circular translation per image: gather rows/columns at (i + shift) mod 32
        sy = torch.randint(0, max_shift + 1, (n,), generator=gen)
        sx = torch.randint(0, max_shift + 1, (n,), generator=gen)
        rows = ((torch.arange(size)[None, :] + sy[:, None]) % size)[:, None, :, None].expand(n, 3, size, size)
        x = torch.gather(x, 2, rows)
        cols = ((torch.arange(size)[None, :] + sx[:, None]) % size)[:, None, None, :].expand(n, 3, size, size)
        x = torch.gather(x, 3, cols)
        x = x + 0.3 * torch.randn(n, 3, 1, 1, generator=gen) + noise * torch.randn(x.shape, generator=gen)
        return (128 + 48 * x).round().clamp(0, 255).to(torch.uint8)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=gen)]
        chunks = [make_chunk(labels[i : i + 8192]) for i in range(0, n, 8192)]  # bounded peak memory
        images = torch.cat(chunks) if chunks else torch.empty(0, 3, size, size, dtype=torch.uint8)
        return images, labels

    return make(n_train), make(n_test)


# ------------------------------------------------------------------------------------------------ pipeline
def normalize(x: torch.Tensor, mean=CIFAR10_MEAN, std=CIFAR10_STD) -> torch.Tensor:
    """uint8 (or [0, 255] float) images → float32, scaled to [0, 1], minus the channel mean, over the std."""
    x = x.float().div_(255.0)
    m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - m) / s


def augment(x: torch.Tensor, padding: int = 4, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The standard CIFAR augmentation on a batch ``(N, C, H, W)``: random crop of the original size from the
    image zero-padded by ``padding`` on each side, then a horizontal flip with probability ½; per example."""
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    top = torch.randint(0, 2 * padding + 1, (n,), device=x.device, generator=generator)
    left = torch.randint(0, 2 * padding + 1, (n,), device=x.device, generator=generator)
    rows = (top[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (n, h, 1)
    cols = (left[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (n, 1, w)
    flip = torch.rand(n, device=x.device, generator=generator) < 0.5
    cols = torch.where(flip[:, None, None], (cols.flip(-1)), cols)
    index = torch.arange(n, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[index, rows, cols]  # (n, h, w, c)
    return out.permute(0, 3, 1, 2).contiguous()


class TensorBatches(Dataset):
    """Images and labels indexed by a list of indices at once (a whole batch per ``__getitem__``)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError("images and labels differ in length")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


def loader(images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, train: bool, seed: int = 0) -> DataLoader:
    """A DataLoader over uint8 images (augmentation and normalisation happen on the device, in the module).
    Training: reshuffled every epoch (seeded), incomplete last batch dropped."""
    data = TensorBatches(images, labels)
    if train:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(data)
    return DataLoader(data, sampler=BatchSampler(sampler, batch_size, drop_last=train), batch_size=None)
