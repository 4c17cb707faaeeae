"""A real image pipeline for bench_images.py: JPEG photographs decoded and augmented in ``__getitem__``.

The JPEGs are made once from the colour photographs that scikit-image ships (random crops,
rescales and flips at ImageNet-like sizes, quality 90), deterministically from a seed, and
cached in one file under /tmp keyed by the arguments. Every process (a trainer, torch's
workers, the daemon's pool workers) opens that file and reads an item's bytes with
``os.pread``, as ImageFolder reads a JPEG from the page cache: the encoded data is in no
process's PSS, so the memory figures are the loaders', not N copies of the data set.

The optional ``bench`` extra installs torchvision and scikit-image (skimage itself is never
imported: it pulls in scipy; only its data folder is read).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
from PIL import Image
from torch.utils.data import Dataset

# Colour photographs in skimage/data (RGB; grey, RGBA, synthetic and tiny images left out).
PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "ihc.png",
)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's
FORMAT = b"LDJPEG01"  # cache file: magic, uint64 n, n x (offset, length, label) int64, then the JPEGs


def import_transforms() -> Any:
    """``torchvision.transforms``, also where torchvision's compiled ops cannot load.

    PyPI's torchvision wheels for Linux are CUDA builds; next to a CPU-only torch
    (``torch==2.13.0+cpu``) their ``_C`` extension does not load, and ``import torchvision``
    then fails in ``_meta_registrations`` with "operator torchvision::nms does not exist"
    (pytorch/pytorch#122494). The transforms used here are pure Python on PIL images and
    never call those ops, so the two schemas it registers fake kernels for are declared
    (without kernels) and the import is retried.
    """
    try:
        import torchvision.transforms as transforms
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported package
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import_transforms.lib = lib  # type: ignore[attr-defined]  # the definitions live as long as it
        import torchvision.transforms as transforms
    return transforms


# At import, as a dataset module's ``from torchvision import transforms`` is: a daemon's fork server imports the
# config's modules once and its workers share them, as torch's workers share what their trainer imported. Imported
# in the constructor instead, torchvision (~75 MiB of anonymous memory) would be imported again in every pool worker.
import_transforms()


def photo_dir() -> Path:
    """skimage's bundled data folder, found without importing skimage."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-image is not installed: pip install -e '.[bench]'")
    return Path(spec.submodule_search_locations[0]) / "data"


def _photos() -> list[Image.Image]:
    photos = []
    for name in PHOTOS:
        path = photo_dir() / name
        if path.exists():
            with Image.open(path) as img:
                if img.mode == "RGB":
                    photos.append(img.copy())
    if len(photos) < 3:
        raise RuntimeError(f"only {len(photos)} colour photos found in {photo_dir()}")
    return photos


def _encode(photo: Image.Image, rng: np.random.Generator, quality: int) -> bytes:
    """A random crop of ``photo`` at ImageNet's typical size (long side 400-500, 4:3, a quarter
    portrait), maybe mirrored, as a JPEG."""
    long_side = int(rng.integers(400, 501))
    width, height = long_side, long_side * 3 // 4
    if rng.random() < 0.25:
        width, height = height, width
    # The largest crop of the photo with the target's aspect ratio, scaled by 0.5-1 in area.
    scale = min(photo.width / width, photo.height / height) * float(np.sqrt(rng.uniform(0.5, 1.0)))
    crop_w, crop_h = max(1, int(width * scale)), max(1, int(height * scale))
    left = int(rng.integers(0, photo.width - crop_w + 1))
    top = int(rng.integers(0, photo.height - crop_h + 1))
    img = photo.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.Resampling.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=quality)  # 4:2:0 chroma subsampling, as most photos
    return out.getvalue()


def jpeg_cache(n: int, seed: int = 0, quality: int = 90) -> Path:
    """The cache file for these arguments, made if missing (atomically: concurrent makers write
    the same bytes, and the last rename wins)."""
    key = json.dumps([FORMAT.decode(), n, seed, quality, PIL.__version__, sorted(PHOTOS)])
    path = Path("/tmp") / f"loaderd-bench-jpeg-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"
    if path.exists():
        return path
    photos = _photos()
    rng = np.random.default_rng(seed)
    blobs, labels = [], []
    for i in range(n):
        label = i % len(photos)  # the class is the source photograph
        blobs.append(_encode(photos[label], rng, quality))
        labels.append(label)
    header = len(FORMAT) + 8 + 24 * n
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    offsets = header + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    index = np.stack([offsets, lengths, np.array(labels, dtype=np.int64)], axis=1)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(FORMAT + np.uint64(n).tobytes() + index.tobytes())
        for blob in blobs:
            out.write(blob)
    os.replace(tmp, path)
    return path


class JpegFile(Dataset):
    """``n`` JPEG photographs in the cache file; ``length`` (default ``n``) items per epoch, item
    ``i`` from JPEG ``i % n``. The constructor only opens the file and reads its index (cheap in
    every worker); subclasses say what an item is. ``latency_ms``: each read first waits that long (a sleep, which
    releases the GIL), as a read from network storage (an object store, NFS) does."""

    def __init__(self, n: int = 512, seed: int = 0, quality: int = 90, length: int | None = None, latency_ms: float = 0.0) -> None:
        self.length = n if length is None else length
        self.latency_s = latency_ms / 1000
        self.path = jpeg_cache(n, seed, quality)
        with open(self.path, "rb") as f:
            if f.read(len(FORMAT)) != FORMAT:
                raise RuntimeError(f"{self.path} is not a JPEG cache file")
            count = int(np.frombuffer(f.read(8), dtype=np.uint64)[0])
            self.index = np.frombuffer(f.read(24 * count), dtype=np.int64).reshape(count, 3).tolist()
        self.fd = os.open(self.path, os.O_RDONLY)  # pread is positionless: safe across fork

    def __len__(self) -> int:
        return self.length

    def read(self, i: int) -> bytes:
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        offset, length, _ = self.index[i % len(self.index)]
        return os.pread(self.fd, length, offset)

    def label(self, i: int) -> int:
        return self.index[i % len(self.index)][2]

    @staticmethod
    def decode(data: bytes) -> Image.Image:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")

    def __getstate__(self) -> dict[str, Any]:  # for spawned workers: the descriptor is per process
        return {k: v for k, v in self.__dict__.items() if k != "fd"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)


class JpegImages(JpegFile):
    """``n`` JPEG photographs; item ``i`` is ``(float32 3x224x224 tensor, int label)`` of JPEG
    ``i % n`` after PIL decoding (as ImageFolder's loader) and RandomResizedCrop, flip, ToTensor,
    Normalize. ``length`` (default ``n``) items per epoch: a long epoch over few distinct files."""

    def __init__(
        self, n: int = 512, seed: int = 0, quality: int = 90, size: int = 224, length: int | None = None, latency_ms: float = 0.0
    ) -> None:
        super().__init__(n, seed, quality, length, latency_ms)
        T = import_transforms()
        self.crop, self.flip = T.RandomResizedCrop(size), T.RandomHorizontalFlip()
        self.to_tensor, self.normalize = T.ToTensor(), T.Normalize(MEAN, STD)
        self.transform = T.Compose([self.crop, self.flip, self.to_tensor, self.normalize])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.decode(self.read(i))), self.label(i)


# ---------------------------------------------------------------- the pipeline split for an item cache
# The same photographs, the work split in two: the dataset's deterministic part (decode, resize the
# shorter side to 256, centre crop 256x256, a uint8 CHW tensor: draws no random number, so an item
# cache may keep it) and ``augment_resized``, the random part (RandomCrop(224), RandomHorizontalFlip
# on the uint8 tensor, with torch's RNG, then float32 / 255 and Normalize), which runs on every item
# every epoch. torch's side composes the two in one ``__getitem__`` (JpegResizedAugmented).

RESIZED = 256  # the cached item's side: 3 x 256 x 256 uint8 = 192 KiB
CROP = 224


class JpegResized(JpegFile):
    """Item ``i``: ``(uint8 tensor 3x256x256, int label)``: JPEG ``i % n`` decoded with PIL, its shorter
    side resized to 256 (bilinear, antialiased) and centre-cropped to 256x256. Deterministic."""

    def __init__(self, n: int = 512, seed: int = 0, quality: int = 90, length: int | None = None) -> None:
        super().__init__(n, seed, quality, length)
        T = import_transforms()
        self.resize, self.center, self.to_uint8 = T.Resize(RESIZED), T.CenterCrop(RESIZED), T.PILToTensor()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.to_uint8(self.center(self.resize(self.decode(self.read(i))))), self.label(i)


_AUGMENT: dict[str, Any] = {}


def augment_steps() -> dict[str, Any]:
    """``augment_resized``'s steps by name (built once per process)."""
    if not _AUGMENT:
        T = import_transforms()
        _AUGMENT.update({
            "RandomCrop(224)": T.RandomCrop(CROP),
            "RandomHorizontalFlip": T.RandomHorizontalFlip(),
            "to float32 / 255": lambda image: image.to(torch.float32).div_(255),
            "Normalize": T.Normalize(MEAN, STD, inplace=True),  # on the float copy just made
        })  # fmt: skip
    return _AUGMENT


def augment_resized(item: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """The random part of an item: ``(uint8 3x256x256, label)`` -> ``(float32 3x224x224 normalized, label)``.

    A daemon's ``transform:`` (``image_datasets:augment_resized``); never changes its input in place
    (a cached item may be read again)."""
    image, label = item
    for step in augment_steps().values():
        image = step(image)
    return image, label


class JpegResizedAugmented(JpegResized):
    """torch's side of the split pipeline: ``augment_resized(JpegResized[i])``, every item, every epoch."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return augment_resized(super().__getitem__(i))
