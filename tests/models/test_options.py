"""models.RunOptions holds the run's one ShardingRules: built once from the mesh, layout and
param_sharding when not given, taken as given (the trainer's) otherwise, built anew when the
placement changes, and refused when it places elsewhere."""

import jax
import pytest

import basp_jax
import models
from basp_jax.sharding import ShardingRules

pytestmark = pytest.mark.usefixtures("compile_cache")  # this run's (tests/conftest.py)


def _layout():
    return basp_jax.Layout.plan(8, 2, 64, 4, 2, groups=2, devices_per_host=4)


def test_rules_are_built_once_from_the_placement():
    layout = _layout()
    mesh = basp_jax.make_mesh(layout)
    options = models.RunOptions(mesh=mesh, layout=layout, param_sharding="host")
    assert options.rules == ShardingRules("host", mesh, 4)
    assert options.rules is options.rules
    assert models.RunOptions().rules is None
    changed = models.RunOptions.of(options, param_sharding="hsdp")
    assert changed.rules == ShardingRules("hsdp", mesh, 4)
    assert models.RunOptions.of(options, remat="full").rules is options.rules


def test_given_rules_are_the_options_own_and_must_agree():
    layout = _layout()
    mesh = basp_jax.make_mesh(layout)
    rules = ShardingRules("hsdp", mesh, 4)
    options = models.RunOptions(mesh=mesh, layout=layout, param_sharding="hsdp", rules=rules)
    assert options.rules is rules
    with pytest.raises(models.ModelError, match="disagree"):
        models.RunOptions(mesh=mesh, layout=layout, param_sharding="fsdp", rules=rules)


def test_the_trainer_and_the_model_share_one_rules_object(tmp_path):
    from train.program import state
    from train.program.model_setup import model_config, model_options

    from tests.helpers.trainer import tiny_config

    cfg = tiny_config(tmp_path / "run")
    plan = state.plan_run(cfg, model_config(cfg), jax.devices(), 4)
    assert model_options(cfg, plan).rules is plan.rules


def test_a_packed_runs_document_bound_reaches_the_model(tmp_path):
    """The trainer sizes cuDNN's packed layout by its data: the plan carries the most documents
    a packed row holds (train.data.Pipeline.documents_per_row) into the model's options."""
    from train.prepare import check
    from train.program.model_setup import model_options

    from tests.helpers.trainer import packed_stream, tiny_config

    packed_stream(tmp_path / "docs.bin")
    cfg = tiny_config(tmp_path / "run", "data.source=tokens", f"data.path={tmp_path / 'docs.bin'}",
                      "data.pack=true", "data.eos_id=0")
    run = check(cfg, is_writer=True)
    bound = run.data.documents_per_row
    assert bound and bound > 1 and run.plan.document_bound == bound
    assert model_options(run.cfg, run.plan).document_bound == bound
    with pytest.raises(models.ModelError, match="document_bound must be a positive"):
        models.RunOptions(document_bound=0)
