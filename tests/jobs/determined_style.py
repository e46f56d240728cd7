"""Client code written for Determined's Torch Batch Processing API; only the import line was changed.

(Originally ``from determined import pytorch`` / ``from determined.pytorch import experimental``.)
"""

import pathlib

import torch
import torchvision.transforms as transforms

from torch_batch_process import pytorch
from torch_batch_process.pytorch import experimental


class CountReducer(pytorch.MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.count = 0

    def update(self, value):
        self.count += value

    def per_slot_reduce(self):
        return self.count

    def cross_slot_reduce(self, per_slot_metrics):
        return sum(per_slot_metrics)


class InferenceProcessor(experimental.TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        torch.manual_seed(0)
        self.model = context.prepare_model_for_inference(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10)))
        self.output = []
        self.last_index = 0
        self.rank = self.context.distributed.get_rank()
        self.seen = context.wrap_reducer(reducer=CountReducer(), name="examples")

    def process_batch(self, batch, batch_idx) -> None:
        model_input = batch[0]
        model_input = self.context.to_device(model_input)

        with torch.no_grad():
            pred = self.model(model_input)
            output = {"predictions": pred, "input": batch}
            self.output.append(output)
        self.seen.update(len(batch[1]))
        self.last_index = batch_idx

    def on_checkpoint_start(self):
        """During checkpoint, we persist prediction result"""
        if len(self.output) == 0:
            return
        file_name = f"prediction_output_{self.last_index}"
        with self.context.upload_path() as path:
            file_path = pathlib.Path(path, file_name)
            torch.save(self.output, file_path)

        self.output = []


class Images(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
        self.transform = transforms.Compose([transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        image = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(index))
        return self.transform(image), index


if __name__ == "__main__":
    inference_data = Images(1000)
    experimental.torch_batch_process(
        InferenceProcessor,
        inference_data,
        batch_size=64,
        checkpoint_interval=10,
        dataloader_kwargs={"num_workers": 2},
    )
