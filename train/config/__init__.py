"""What a run is: the typed config (schema), read from YAML with includes and overrides (tree),
checked without JAX; the dtypes it names, the paths it takes, what a resume may change of it
(resume) and the file fingerprints that notice a replaced input (fingerprint).

    from train.config import load_config
    cfg = load_config("configs/demo_cpu.yaml", ["train.steps=10"])
"""

from .errors import ConfigError
from .schema import (CheckpointConfig, Config, DataConfig, EvalConfig, MetricsConfig,
                     ModelSection, OptimizerConfig, ParallelConfig, ProfileConfig, RunConfig,
                     TrainSection, from_dict, load_config, replace, to_dict, to_yaml)
from .runtime_section import RuntimeConfig

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
           "MetricsConfig", "ModelSection", "OptimizerConfig", "ParallelConfig", "ProfileConfig",
           "RunConfig", "RuntimeConfig", "TrainSection", "from_dict", "load_config", "replace",
           "to_dict", "to_yaml"]
