"""The corpus of ``time_to_quality.py``: real text nobody here wrote, on every machine.

By default the Python source files of the running interpreter's standard library
(``sysconfig``'s ``stdlib`` folder, ``site-packages`` left out); any folder and glob can be
given instead. Each file goes to the held-out split when the first byte of the SHA-1 of its
path relative to the folder is below ``256 * held_out`` (deterministic, independent of the
machine's file order). Tokens: a byte-level BPE vocabulary trained on the training files
with the ``tokenizers`` library and cached beside the token arrays (or raw bytes,
``vocab=0``), under ``$SPARSE_TRAINING_CACHE/corpus`` (default ``~/.cache/sparse_training``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


def stdlib_folder() -> Path:
    """The running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(folder: Path, pattern: str = "**/*.py") -> list[Path]:
    """The files of ``folder`` matching ``pattern``, sorted, without ``site-packages`` /
    ``dist-packages`` (installed packages are not the standard library)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in folder.glob(pattern)
                  if p.is_file() and not skip & set(p.relative_to(folder).parts))


def is_held_out(relative: str, held_out: float) -> bool:
    """Whether the file at ``relative`` (a path inside the folder) is held out."""
    return hashlib.sha1(relative.encode()).digest()[0] < 256 * held_out


@dataclass
class Corpus:
    """Token ids of the training and held-out files, and the vocabulary size."""

    train: torch.Tensor
    held_out: torch.Tensor
    vocab: int
    files: tuple[int, int]  # training files, held-out files

    def describe(self) -> dict:
        return {"train_tokens": self.train.numel(), "held_out_tokens": self.held_out.numel(),
                "vocab": self.vocab, "train_files": self.files[0],
                "held_out_files": self.files[1]}


def load_corpus(folder: Path | None = None, pattern: str = "**/*.py", vocab: int = 8192,
                held_out: float = 0.05, cache: Path | None = None) -> Corpus:
    """The corpus of ``folder`` (default: the standard library), tokenized and cached.

    Raises:
        ValueError: no file matches, or either split is empty.
    """
    folder = Path(folder or stdlib_folder()).resolve()
    files = corpus_files(folder, pattern)
    split = {True: [], False: []}
    for path in files:
        split[is_held_out(str(path.relative_to(folder)), held_out)].append(path)
    if not split[True] or not split[False]:
        raise ValueError(f"{folder} with {pattern!r}: {len(split[False])} training and "
                         f"{len(split[True])} held-out files; both splits need at least one "
                         f"(give more files or another --held-out)")
    key = hashlib.sha1(json.dumps([str(folder), pattern, vocab, held_out, [
        (str(p), p.stat().st_size) for p in files]]).encode()).hexdigest()[:16]
    root = Path(cache or Path(os.environ.get("SPARSE_TRAINING_CACHE")
                              or Path.home() / ".cache" / "sparse_training")) / "corpus" / key
    if (root / "train.pt").exists() and (root / "held_out.pt").exists():
        saved = torch.load(root / "train.pt"), torch.load(root / "held_out.pt")
        meta = json.loads((root / "meta.json").read_text())
        return Corpus(*saved, meta["vocab"], (len(split[False]), len(split[True])))
    texts = {name: [p.read_text(encoding="utf-8", errors="replace") for p in split[held]]
             for name, held in (("train", False), ("held_out", True))}
    encode, size = _encoder(texts["train"], vocab, root)
    ids = {name: torch.tensor([t for text in group for t in encode(text)], dtype=torch.int32)
           for name, group in texts.items()}
    root.mkdir(parents=True, exist_ok=True)
    torch.save(ids["train"], root / "train.pt")
    torch.save(ids["held_out"], root / "held_out.pt")
    (root / "meta.json").write_text(json.dumps({"vocab": size, "folder": str(folder)}))
    return Corpus(ids["train"], ids["held_out"], size, (len(split[False]), len(split[True])))


def _encoder(train_texts: list[str], vocab: int, root: Path):
    """``(encode(text) -> ids, vocabulary size)``: bytes for ``vocab=0``, else a byte-level
    BPE of ``vocab`` entries trained on ``train_texts`` (saved as ``root/bpe.json``)."""
    if vocab == 0:
        return (lambda text: list(text.encode("utf-8"))), 256
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(train_texts, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "bpe.json"))
    return (lambda text: tokenizer.encode(text).ids), tokenizer.get_vocab_size()
