"""The digits classifier of the example: a tiny CNN over 8x8 grayscale images, and its data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn
from torchvision import transforms

WEIGHTS = Path(__file__).with_name("digits_cnn.pt")
TEST_FRACTION = 0.3

# torchvision preprocessing: PIL image -> normalized 1x8x8 tensor.
TRANSFORM = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])


def build_model() -> nn.Module:
    """A small CNN for 8x8 digits (about 10k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def load_trained_model() -> nn.Module:
    model = build_model()
    model.load_state_dict(torch.load(WEIGHTS, map_location="cpu", weights_only=True))
    return model


def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits, split deterministically: (train_images, train_labels, test_images, test_labels)."""
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))
    cut = int(len(images) * (1 - TEST_FRACTION))
    train, test = order[:cut], order[cut:]
    return images[train], digits.target[train], images[test], digits.target[test]


class DigitsDataset(torch.utils.data.Dataset):
    """Held-out digits as (image tensor, label, index) through torchvision transforms."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image = Image.fromarray(self.images[index])  # uint8 2-D array: grayscale "L"
        return TRANSFORM(image), int(self.labels[index]), index


def test_dataset() -> DigitsDataset:
    _, _, images, labels = split()
    return DigitsDataset(images, labels)
