"""The MNIST loader: checksums, download (from a local file:// mirror), error messages."""

from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import mnist_data  # noqa: E402
from mnist_data import SHA256, ensure_files, load_mnist, read_idx, resolve_data_dir  # noqa: E402

SHARED = mnist_data.resolve_data_dir(None)
needs_mnist = pytest.mark.skipif(
    not all((SHARED / name).is_file() for name in SHA256),
    reason=f"MNIST files not in {SHARED}; set ${mnist_data.ENV_VAR}",
)
UNREACHABLE = ("http://127.0.0.1:9/",)  # discard port: connection refused at once


@needs_mnist
def test_load_shapes_and_normalization() -> None:
    data = load_mnist(SHARED, download=False)
    assert data.train_x.shape == (60000, 784) and data.test_x.shape == (10000, 784)
    assert data.train_y.bincount().tolist()[:2] == [5923, 6742]
    assert data.test_y.min() == 0 and data.test_y.max() == 9
    assert abs(data.train_x.mean().item()) < 1e-3  # normalized with the training mean and std
    assert abs(data.train_x.std().item() - 1.0) < 1e-2


@needs_mnist
def test_read_idx_header() -> None:
    images = read_idx(SHARED / "t10k-images-idx3-ubyte.gz")
    assert images.shape == (10000, 28, 28) and images.dtype.name == "uint8"


def test_resolve_data_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(mnist_data.ENV_VAR, raising=False)
    assert resolve_data_dir(None) == Path("data/mnist")
    monkeypatch.setenv(mnist_data.ENV_VAR, str(tmp_path))
    assert resolve_data_dir(None) == tmp_path
    assert resolve_data_dir("elsewhere") == Path("elsewhere")


@needs_mnist
def test_downloads_missing_files_from_mirror(tmp_path: Path) -> None:
    target = tmp_path / "mnist"
    # The first mirror refuses, the second (a file:// URL) serves the originals.
    ensure_files(target, mirrors=(*UNREACHABLE, SHARED.resolve().as_uri() + "/"))
    assert sorted(p.name for p in target.iterdir()) == sorted(SHA256)  # no temporary files left


def test_no_network_message_names_files_and_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="MNIST files missing from") as info:
        ensure_files(tmp_path, mirrors=UNREACHABLE, timeout=2)
    message = str(info.value)
    assert str(tmp_path.resolve()) in message
    assert all(name in message for name in SHA256)
    assert "127.0.0.1:9" in message and mnist_data.ENV_VAR in message
    assert list(tmp_path.iterdir()) == []  # no half-downloaded files


def test_download_disabled_message(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="download disabled"):
        ensure_files(tmp_path, download=False)


@needs_mnist
def test_wrong_checksum_is_an_error(tmp_path: Path) -> None:
    for name in SHA256:
        shutil.copy(SHARED / name, tmp_path / name)
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(b"not mnist")
    with pytest.raises(ValueError, match=r"SHA-256 of .*t10k-labels-idx1-ubyte.gz is .* expected"):
        ensure_files(tmp_path, download=False)


def test_mirror_serving_wrong_bytes_is_rejected(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in SHA256:
        (mirror / name).write_bytes(b"corrupt")
    with pytest.raises(FileNotFoundError, match="SHA-256 mismatch"):
        ensure_files(tmp_path / "mnist", mirrors=(mirror.as_uri() + "/",))
    assert list((tmp_path / "mnist").iterdir()) == []
