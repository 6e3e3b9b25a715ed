"""Train a model: ``python train.py [experiment=...] [model=...] [attention=moh attention.activation_ratio=0.5] ...``

With no arguments: a small MoH TransNeXt on the embedded digits (CPU, no download). See README.md.
"""
from moh_vision.config import hydra_main


@hydra_main("train")
def main(cfg) -> float:
    from moh_vision.apps.run import train
    summary = train(cfg)
    return summary.get("val/acc1", summary.get("sample/class_acc", 0.0))  # the value Optuna sweeps optimise


if __name__ == "__main__":
    main()
