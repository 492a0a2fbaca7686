"""One ZeRO-0 fp16 SGD step with a static loss scale; saves the update and the fp32 reference's.

Run under the ``deepspeed`` launcher with the fork or with a pristine upstream on PYTHONPATH
(the saved file records which ``deepspeed`` ran). The reference is the same step in fp32 with
plain torch: with loss scale S, an fp16 optimizer that does not pre-scale the loss applies
update / S.

    deepspeed --num_gpus 1 zero0_fp16_step.py --out step.pt [--loss-scale 1024]
"""

import argparse
import os

import torch

LR = 0.5
IN_FEATURES, HIDDEN, OUT_FEATURES, BATCH = 16, 32, 8, 8


def build_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT_FEATURES))


def batch():
    generator = torch.Generator().manual_seed(8)
    return torch.randn(BATCH, IN_FEATURES, generator=generator), torch.randn(BATCH, OUT_FEATURES, generator=generator)


def reference_update():
    model = build_model()
    inputs, targets = batch()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: -LR * param.grad for name, param in model.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss-scale", type=float, default=1024.0)
    parser.add_argument("--local_rank", type=int, default=0, help="appended by the launcher")
    args = parser.parse_args()

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        # oneDNN lacks fp16 on this CPU; torch's own CPU kernels run fp16 (slower), enough here.
        type(accelerator).is_fp16_supported = lambda self: True

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model()
    before = {name: param.detach().float().clone() for name, param in model.named_parameters()}
    config = {"train_batch_size": BATCH, "steps_per_print": 1000, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 0}, "fp16": {"enabled": True, "loss_scale": args.loss_scale}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                   optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    inputs, targets = batch()
    loss = torch.nn.functional.mse_loss(engine(inputs.half()).float(), targets)
    engine.backward(loss)
    engine.step()
    after = {name: param.detach().float() for name, param in engine.module.named_parameters()}
    torch.save({"deepspeed_file": os.path.realpath(deepspeed.__file__), "optimizer": type(optimizer).__name__,
                "update": {name: after[name] - before[name] for name in before}, "reference": reference_update()},
               args.out)
    deepspeed.comm.destroy_process_group()  # else gloo's threads may abort the interpreter's exit


if __name__ == "__main__":
    main()
