"""Evaluate a checkpoint: ``python eval.py ckpt=<path> [data=...] [eval.use_ema=true]`` (its config travels inside it)."""
import hydra
from omegaconf import DictConfig

from moh_vision.cli import run_cli


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from moh_vision.engine.run import evaluate
    run_cli(evaluate, cfg)


if __name__ == "__main__":
    main()
