"""A data module for tests: the digits, with images that turn to NaN from a given training index on
(simulating corrupt inputs). Selected from the command line with ``data=custom data.name=nan_data:NaNDigits``."""
import torch

from moh_vision.data.digits import DigitsData


class _NaNAfter(torch.utils.data.Dataset):
    def __init__(self, base, nan_from: int):
        self.base, self.nan_from = base, nan_from

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return (torch.full_like(x, float("nan")) if i >= self.nan_from else x), y


class NaNDigits(DigitsData):
    """Every training image with index >= ``nan_from`` is NaN."""

    def __init__(self, nan_from: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.train = _NaNAfter(self.train, nan_from)
