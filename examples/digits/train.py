"""Trains the example's digits CNN in a few seconds and writes digits_cnn.pt next to this file.

The weights are shipped with the repository; run this only to regenerate them:
    python examples/digits/train.py
"""

from __future__ import annotations

import torch
from model import WEIGHTS, DigitsDataset, build_model, split


def main() -> None:
    torch.manual_seed(0)
    train_images, train_labels, test_images, test_labels = split()
    train = DigitsDataset(train_images, train_labels)
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(15):
        for images, labels, _ in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
    model.eval()
    test = DigitsDataset(test_images, test_labels)
    with torch.no_grad():
        images = torch.stack([test[i][0] for i in range(len(test))])
        accuracy = (model(images).argmax(1) == torch.as_tensor(test_labels)).float().mean().item()
    torch.save(model.state_dict(), WEIGHTS)
    print(f"test accuracy {accuracy:.4f}; weights written to {WEIGHTS}")


if __name__ == "__main__":
    main()
