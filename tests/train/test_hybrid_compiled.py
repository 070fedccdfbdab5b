"""The planner against the hybrid's compiled GPU programs (Qwen3.5-9B at 16K, B=2, 2 x 4
A100-40GB), recorded in bench/gpu_compile/qwen3.5-9b_a100-40gb_2x4.json by the command in
BENCHMARKS.md section 6: its 32 listed layers take 7-12 minutes to compile on 2 CPU cores, too
long for the GPU-compile tier (tests/e2e/test_gpu_compile.py), so the formula is checked here
against what those compiles measured."""

import json
from pathlib import Path

import pytest

import models
from basp_jax.planner import cost
from train.program import planning
from train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "bench/gpu_compile/qwen3.5-9b_a100-40gb_2x4.json"
REPORTS = json.loads(RECORDED.read_text())


def _plan(case: str):
    path, *overrides = case.split(",")
    cfg = load_config(str(ROOT / path), overrides)
    mcfg = models.ModelConfig.preset(cfg.model.preset)
    layout, strategy = planning.plan(cfg, mcfg, cfg.runtime.devices, cfg.parallel.devices_per_host)
    return cfg, mcfg, layout, strategy


def test_the_recorded_programs_are_the_shipped_configs():
    """Both configs, with the GPU defaults' flags (what a run compiles) and without the overlap
    flags (what the formula is fitted to, as the GPU-compile tier compiles the others)."""
    cases = {(r["case"], r["flags"]) for r in REPORTS}
    for config in ("configs/gpu/qwen3.5-9b_basp.yaml", "configs/gpu/qwen3.5-9b_ulysses.yaml"):
        assert (config, "gpu defaults") in cases
    assert ("configs/gpu/qwen3.5-9b_basp.yaml", "no overlap") in cases
    for r in REPORTS:
        cfg, _, layout, strategy = _plan(r["case"])
        assert (r["layout"]["mode"], r["param_sharding"]) == (cfg.parallel.mode, strategy)
        assert (r["layout"]["groups"], r["layout"]["sp"]) == (layout.groups, layout.sp)
        assert (r["hosts"], r["gpus_per_host"], r["target"]["name"]) == (2, 4, "a100-40gb")


@pytest.mark.parametrize("report", REPORTS, ids=lambda r: f"{r['case']}|{r['flags']}")
def test_the_planners_memory_is_within_15_percent_of_the_compiled_hybrid(report):
    cfg, mcfg, layout, strategy = _plan(report["case"])
    formula = planning.memory_estimate(cfg, mcfg, layout, strategy)[0]
    assert abs(formula / report["peak_bytes_per_device"] - 1) <= 0.15, (
        formula / 2**30, report["peak_bytes_per_device"] / 2**30)
    if "," not in report["case"]:  # the shipped configs fit their cluster
        assert report["fits"]


@pytest.mark.parametrize("report", REPORTS, ids=lambda r: f"{r['case']}|{r['flags']}")
def test_the_planners_all_to_all_bytes_are_the_compiled_hybrids(report):
    """Attention's and the Gated DeltaNet's exchanges, to within a part in a thousand: under
    BASP none crosses hosts."""
    cfg, mcfg, layout, strategy = _plan(report["case"])
    pred = cost.predict(planning.model_shape(mcfg), layout, strategy,
                        hw=planning.hardware(cfg, layout.devices_per_host), remat=cfg.model.remat)
    rows = [c for c in report["collectives"] if c["kind"] == "all-to-all"]
    wire = sum(c["wire_bytes"] for c in rows)
    inter = sum(c["inter_host_wire_bytes"] for c in rows)
    assert pred.all_to_all.intra + pred.all_to_all.inter == pytest.approx(wire, rel=1e-3)
    assert pred.all_to_all.inter == pytest.approx(inter, rel=1e-3, abs=1.0)
    assert pred.all_to_all.launches == sum(c["count"] for c in rows)
    if cfg.parallel.mode == "basp":
        assert inter == 0
