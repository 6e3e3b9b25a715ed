"""Train a model: ``python train.py [task=diffusion] [model=...] [attention=moh attention.activation_ratio=0.5] ...``

With no arguments: a small MoH TransNeXt on the embedded digits (CPU, no download). See README.md.
"""
import hydra
from omegaconf import DictConfig

from moh_vision.cli import run_cli


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float:
    from moh_vision.engine.run import train
    summary = run_cli(train, cfg)
    return summary.get("val/acc1", summary.get("sample/class_acc", 0.0))  # the value Optuna sweeps optimise


if __name__ == "__main__":
    main()
