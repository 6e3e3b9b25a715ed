"""Evaluate a checkpoint: ``python eval.py ckpt=<path> [data=...] [eval.use_ema=true]`` (its config travels inside it),
or released weights as timm's validate.py does: ``python eval.py model=<preset> pretrained=<file | hub id | true>
data=imagenet data.root=<dir>``."""
from moh_vision.config import hydra_main


@hydra_main("eval")
def main(cfg) -> None:
    from moh_vision.apps.run import evaluate
    evaluate(cfg)


if __name__ == "__main__":
    main()
