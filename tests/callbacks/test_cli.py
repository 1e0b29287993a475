"""SparsityCallback configured from a LightningCLI YAML (trainer.callbacks, class_path)."""

from conftest import TinyNet, make_loader
from pytorch_lightning.cli import LightningCLI
from torch import nn

from sparse_training import SparsityCallback

CONFIG = """
trainer:
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  accelerator: cpu
  callbacks:
    - class_path: sparse_training.SparsityCallback
      init_args:
        pattern: "unstructured"   # quote N:M patterns: YAML reads 2:4 as the number 124
        sparsity: 0.75
        schedule: gmp
        frequency: 2
        layer_types: [Linear, torch.nn.Conv2d]
        deny: ['net\\.4']
        overrides:
          'net\\.0': {pattern: "1:4"}
model:
  lr: 0.01
"""


def test_lightning_cli_builds_and_trains_the_callback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the CLI saves the config it ran with in the working folder
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    cli = LightningCLI(TinyNet, run=False, args=["--config", str(path)],
                       save_config_kwargs={"overwrite": True})
    (sparse,) = [c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)]
    assert sparse.config.layer_types == (nn.Linear, nn.Conv2d)
    assert sparse.config.parsed_overrides[r"net\.0"].pattern.spec == "1:4"
    cli.trainer.fit(cli.model, make_loader())
    assert sparse.engine.tensor_sparsity == {"net.0.weight": 0.75, "net.2.weight": 0.75}


def test_the_cli_sees_every_setting():
    """The callback's signature, written out, is the settings dataclass's: the same names,
    types and defaults, in the same order (what LightningCLI and help() read)."""
    import dataclasses
    import inspect

    from sparse_training import SparsityConfig

    parameters = inspect.signature(SparsityCallback).parameters
    settings = {f.name: f for f in dataclasses.fields(SparsityConfig) if f.init}
    assert [p for p in parameters if parameters[p].kind != inspect.Parameter.VAR_KEYWORD] == (
        list(settings))
    for name, field in settings.items():
        assert parameters[name].default == field.default, name
        assert parameters[name].annotation == field.type, name
    assert "SparsityConfig" in SparsityCallback.__doc__
