# SPDX-License-Identifier: Apache-2.0
"""A pipeline whose stages are sized to their devices: PipelineModule(partition_method="heterogeneous").

Two stages, the second emulated at half speed (time dilation): the start-up table shows 8 blocks on
the full-speed stage and 4 on the other, where upstream's 'parameters' partition gives 6 and 6.

    deepspeed --num_gpus 2 examples/snippets/pipeline.py
"""

import torch

import deepspeed
from deepspeed.pipe import PipelineModule


class Block(torch.nn.Module):

    def __init__(self, width=128):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


deepspeed.init_distributed()
torch.manual_seed(0)
net = PipelineModule(layers=[Block() for _ in range(12)], num_stages=2, loss_fn=torch.nn.MSELoss(),
                     partition_method="heterogeneous")
data = torch.utils.data.TensorDataset(torch.randn(512, 128), torch.randn(512, 128))
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), training_data=data, config={
    "train_batch_size": 64,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
    "heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}},
})
for step in range(5):
    loss = engine.train_batch()
print(f"rank {engine.global_rank}: stage {engine.stage_id} holds layers {net.parts[engine.stage_id]}-"
      f"{net.parts[engine.stage_id + 1] - 1}, loss {loss.item():.4f}")
# Leave without interpreter finalization, where gloo's worker threads can abort a rank after its
# work ("terminate called without an active exception"): destroy the process group, flush, exit.
from deepspeed.runtime.heterogeneous.process_exit import end_process  # noqa: E402

end_process(0)
