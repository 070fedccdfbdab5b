"""What a run keeps: its checkpoints (store: orbax, atomic saves, pruning, restores onto the
mesh) and the Hugging Face export of its weights (hf_export)."""

from .store import (Checkpointer, CheckpointError, SaveFailed, StorageError, checkpoint_dir,
                    complete_steps, inspect_latest)

__all__ = ["CheckpointError", "Checkpointer", "SaveFailed", "StorageError", "checkpoint_dir",
           "complete_steps", "inspect_latest"]
