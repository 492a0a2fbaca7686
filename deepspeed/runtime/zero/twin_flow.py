# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 twin-flow (``offload_optimizer.ratio`` < 1) in checkpoints (``zero3-twin-flow-checkpoint.patch``).

With a ratio below 1, ZeRO-3 steps the sub-groups it keeps on the device with a second optimizer,
``backup_optimizer`` (torch's AdamW), and the offloaded ones with ``DeepSpeedCPUAdam``. Upstream
0.19.8 saves only the CPU optimizer's ``state_dict()``: the device sub-groups' Adam moments and
step counts are lost, and a resumed run restarts them from zero. Both optimizers key their state by
the same fp32 partition tensors, so the checkpoint can carry both in the one optimizer state dict
upstream already writes: ``backup_state_into_saved`` lends the device sub-groups' state to the CPU
optimizer for the time of its ``state_dict()``, ``backup_state_from_loaded`` gives it back after
``load_state_dict``, whichever optimizer saved it (another ratio, another rank's placement). The
format is upstream's: pristine upstream loads such a checkpoint (the extra entries sit unused in
its CPU optimizer's state, a second copy of those moments on the partitions' device), and a
checkpoint without them loads as upstream loads it.
"""


def _device_partitions(optimizer):
    """The fp32 partitions ZeRO-3 steps with ``backup_optimizer`` (upstream's ``_optimizer_step``:
    a sub-group not mapped to 'cpu' and not updated by Muon); none without twin-flow."""
    if getattr(optimizer, "backup_optimizer", None) is None or not getattr(optimizer, "offload_optimizer", False):
        return []
    muon = getattr(optimizer, "sub_groups_using_muon", None) if getattr(optimizer, "use_muon", False) else None
    return [partition for index, partition in enumerate(optimizer.fp32_partitioned_groups_flat)
            if optimizer.subgroup_to_device.get(index) != "cpu" and not (muon and muon[index])]


def backup_state_into_saved(optimizer):
    """Before ``optimizer.optimizer.state_dict()``: add the backup optimizer's per-partition state
    to the CPU optimizer's; returns the partitions lent, for ``backup_state_lent_back``."""
    lent = [p for p in _device_partitions(optimizer) if p in optimizer.backup_optimizer.state]
    for partition in lent:
        optimizer.optimizer.state[partition] = optimizer.backup_optimizer.state[partition]
    return lent


def backup_state_lent_back(optimizer, lent):
    """After the ``state_dict()``: the CPU optimizer no longer holds the lent state."""
    for partition in lent:
        optimizer.optimizer.state.pop(partition, None)


def backup_state_from_loaded(optimizer):
    """After ``optimizer.optimizer.load_state_dict()``: the device sub-groups' state goes to the
    backup optimizer, which steps them (torch moved it to each partition's device and dtype).

    A checkpoint saved with another ratio (or by upstream, or without twin-flow) has a sub-group's
    state from the other optimizer: DeepSpeedCPUAdam counts ``step`` as an int, torch's AdamW as a
    one-element tensor and refuses an int. Each entry's ``step`` is turned into what the optimizer
    that will step it keeps."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    device = set(map(id, _device_partitions(optimizer)))
    cpu_adam = isinstance(optimizer.optimizer, DeepSpeedCPUAdam)
    for partition in list(optimizer.optimizer.state):
        state = optimizer.optimizer.state[partition]
        step = state.get("step") if isinstance(state, dict) else None
        if id(partition) in device:
            optimizer.backup_optimizer.state[partition] = optimizer.optimizer.state.pop(partition)
            if step is not None and not torch.is_tensor(step):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        elif cpu_adam and torch.is_tensor(step):
            state["step"] = int(step.item())
