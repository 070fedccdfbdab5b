"""train.tools.aot (train.tools.fit_advice) refuses, before compiling, a config whose parameters and optimizer state alone
exceed the target GPUs' memory: compiling the Qwen3.5-9B step for one T4 took over 10 minutes to
say the same. No CUDA plugin is needed: the check reads the config and the model's shape."""

import pytest

from tests.helpers.trainer import ROOT


def _config(name, *overrides):
    from train.config.schema import load_config
    from train.prepare import model_config

    cfg = load_config(str(ROOT / "configs/gpu" / name), list(overrides))
    return cfg, model_config(cfg)


@pytest.mark.parametrize("name", ["qwen3.5-9b_basp.yaml", "llama-3.1-8b_basp.yaml",
                                  "llama-3.2-1b_basp.yaml"])
def test_state_that_cannot_fit_one_t4_is_refused_in_one_line(name):
    from train.tools.aot_errors import DoesNotFitUncompiled
    from train.tools.fit_advice import check_state_fits

    cfg, mcfg = _config(name, "optimizer.offload=false")
    with pytest.raises(DoesNotFitUncompiled) as err:
        check_state_fits(cfg, mcfg, "t4-16gb", 1)
    message = str(err.value)
    assert "\n" not in message and "not compiled" in message and "t4-16gb" in message
    assert "optimizer.offload=true" in message  # what would move the state off the GPU


def test_state_that_fits_when_sharded_is_left_to_the_compiler():
    from train.tools.fit_advice import check_state_fits

    cfg, mcfg = _config("llama-3.1-8b_basp.yaml", "optimizer.offload=false")
    check_state_fits(cfg, mcfg, "h100-80gb", 8)  # 75 GiB over 8 GPUs: the compiler decides
    check_state_fits(cfg, mcfg, "t4-16gb", 8)


def test_offloaded_state_is_held_against_the_hosts_memory():
    from train.tools.aot_errors import DoesNotFitUncompiled
    from train.tools.fit_advice import check_state_fits

    cfg, mcfg = _config("qwen3.5-9b_basp.yaml", "optimizer.offload=true")
    check_state_fits(cfg, mcfg, "h100-80gb", 1)  # 83 GiB of state in a DGX's host memory: fits
    with pytest.raises(DoesNotFitUncompiled, match="host memory"):  # a T4 host's share: 11 GB
        check_state_fits(cfg, mcfg, "t4-16gb", 1)


def _on_cluster(name, target, hosts, per_host, *overrides):
    return _config(name, f"parallel.hardware={target}", f"parallel.devices_per_host={per_host}",
                   f"runtime.devices={hosts * per_host}", *overrides)


def test_a_step_the_planner_puts_far_past_the_memory_is_refused_in_one_line():
    """The 9B hybrid at 64K tokens on 2 x 4 T4s: its state fits (10 GiB per GPU), the step (the
    planner: about 32 GiB) does not, by far more than the formula's error."""
    from train.tools.aot_errors import DoesNotFitUncompiled
    from train.tools.fit_advice import check_planned_fit, check_state_fits

    cfg, mcfg = _on_cluster("qwen3.5-9b_basp.yaml", "t4-16gb", 2, 4, "model.dtype=float16",
                            "data.seq_len=65536")
    check_state_fits(cfg, mcfg, "t4-16gb", 8)
    with pytest.raises(DoesNotFitUncompiled) as err:
        check_planned_fit(cfg, mcfg, "t4-16gb", 8)
    assert "\n" not in str(err.value) and "the planner puts the step" in str(err.value)


def test_a_step_near_the_edge_is_left_to_the_compiler():
    """The Colab config at 4x its length on one T4 (the planner: 1.4x the memory) compiles, and
    the report says what would fit (tests/e2e/test_gpu_compile.py); the shipped 8B on its own
    cluster fits."""
    from train.tools.fit_advice import check_planned_fit

    cfg, mcfg = _on_cluster("../colab.yaml", "t4-16gb", 1, 1, "model.dtype=float16",
                            "data.seq_len=262144")
    check_planned_fit(cfg, mcfg, "t4-16gb", 1)
    cfg, mcfg = _on_cluster("llama-3.1-8b_basp.yaml", "h100-80gb", 2, 8)
    check_planned_fit(cfg, mcfg, "h100-80gb", 16)
