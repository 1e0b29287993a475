"""MNIST from the four original IDX .gz files, checked by SHA-256, as in-memory tensors.

    from mnist_data import load_mnist
    data = load_mnist("./data/mnist")            # downloads the files if they are absent
    data.train_x.shape, data.test_x.shape        # (60000, 784), (10000, 784), float32, normalized

Where the files are looked for, in order: the `data_dir` argument, the environment variable
SPARSE_TRAINING_MNIST_DIR, then ./data/mnist. Missing files are downloaded from the mirrors in
MIRRORS (the ones torchvision uses); every file, downloaded or not, must match its SHA-256 in
SHA256. Without network the error names the files and the folder to put them in.

Run it alone to check a folder: `python examples/mnist_data.py [data_dir]`.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ENV_VAR = "SPARSE_TRAINING_MNIST_DIR"
DEFAULT_DIR = Path("data/mnist")

# The standard MNIST mirrors, tried in order (torchvision's list, then TensorFlow's).
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

# SHA-256 of the original files (their MD5s are the ones torchvision pins).
SHA256 = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}

# Mean and std of the training pixels in [0, 1], the usual MNIST normalization.
MEAN, STD = 0.1307, 0.3081


@dataclass(frozen=True)
class MNIST:
    """MNIST as tensors: images flattened and normalized, labels as int64."""

    train_x: torch.Tensor  # (60000, 784) float32
    train_y: torch.Tensor  # (60000,) int64
    test_x: torch.Tensor  # (10000, 784) float32
    test_y: torch.Tensor  # (10000,) int64


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder to use: `data_dir`, else $SPARSE_TRAINING_MNIST_DIR, else ./data/mnist."""
    if data_dir:
        return Path(data_dir).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return DEFAULT_DIR


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(name: str, dest: Path, mirrors: tuple[str, ...], timeout: float) -> list[str]:
    """Fetch `name` into `dest` from the first mirror that serves it; returns the errors seen."""
    errors = []
    for mirror in mirrors:
        url = mirror + name
        # Download into a temporary file of the same folder, then rename: no half files.
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{name}.")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
                shutil.copyfileobj(response, f)
            if sha256(tmp) == SHA256[name]:
                os.replace(tmp, dest)
                return []
            errors.append(f"{url}: SHA-256 mismatch")
        except OSError as e:  # URLError, HTTPError and timeouts are all OSErrors
            errors.append(f"{url}: {e}")
        finally:
            tmp.unlink(missing_ok=True)
    return errors


def ensure_files(
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool = True,
    mirrors: tuple[str, ...] = MIRRORS,
    timeout: float = 30.0,
) -> Path:
    """Make sure the four files are in the folder and match their SHA-256; returns the folder.

    Raises:
        FileNotFoundError: a file is absent and could not be downloaded; the message lists
            the files to put in the folder and where to get them.
        ValueError: a file is present but its SHA-256 is wrong.
    """
    root = resolve_data_dir(data_dir)
    missing = [name for name in SHA256 if not (root / name).is_file()]
    errors: list[str] = []
    if missing and download:
        root.mkdir(parents=True, exist_ok=True)
        for name in missing:
            print(f"downloading {name} into {root}", file=sys.stderr)
            errors += _download(name, root / name, mirrors, timeout)
        missing = [name for name in SHA256 if not (root / name).is_file()]
    if missing:
        tried = "\n".join(f"  {e}" for e in errors) or "  (download disabled)"
        raise FileNotFoundError(
            f"MNIST files missing from {root.resolve()}: {', '.join(missing)}.\n"
            f"Put the four original files there ({', '.join(SHA256)}), e.g. from {MIRRORS[0]}, "
            f"or point data_dir=... or ${ENV_VAR} at a folder that has them.\n"
            f"Download attempts:\n{tried}"
        )
    for name, expected in SHA256.items():
        actual = sha256(root / name)
        if actual != expected:
            raise ValueError(
                f"SHA-256 of {root / name} is {actual}, expected {expected}: "
                "the file is corrupt or not the original; delete it to download it again."
            )
    return root


def read_idx(path: Path) -> np.ndarray:
    """Read a gzipped IDX file of unsigned bytes (magic 2049 labels, 2051 images)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic not in (2049, 2051):
        raise ValueError(f"{path}: IDX magic {magic}, expected 2049 (labels) or 2051 (images)")
    ndim = magic & 0xFF  # low byte of the magic is the number of dimensions
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    return array.reshape(shape)


def _images(path: Path) -> torch.Tensor:
    pixels = torch.from_numpy(read_idx(path).copy()).flatten(1)  # (N, 784) uint8
    return (pixels.float() / 255.0 - MEAN) / STD


def _labels(path: Path) -> torch.Tensor:
    return torch.from_numpy(read_idx(path).copy()).long()


def load_mnist(data_dir: str | os.PathLike | None = None, *, download: bool = True) -> MNIST:
    """Load MNIST into memory (checking, and if needed downloading, the files first)."""
    root = ensure_files(data_dir, download=download)
    return MNIST(
        train_x=_images(root / "train-images-idx3-ubyte.gz"),
        train_y=_labels(root / "train-labels-idx1-ubyte.gz"),
        test_x=_images(root / "t10k-images-idx3-ubyte.gz"),
        test_y=_labels(root / "t10k-labels-idx1-ubyte.gz"),
    )


if __name__ == "__main__":
    mnist = load_mnist(sys.argv[1] if len(sys.argv) > 1 else None)
    print(
        f"train {tuple(mnist.train_x.shape)}, test {tuple(mnist.test_x.shape)}, "
        f"labels {mnist.train_y.bincount().tolist()}"
    )
