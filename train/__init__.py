"""The basp-jax trainer: `python train.py --config configs/NAME.yaml [key.sub=value ...]`.

    from train.config import load_config
    from train.loop import run
    summary = run(load_config("configs/demo_cpu.yaml", ["train.steps=10"]))
"""
