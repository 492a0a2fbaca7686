# SPDX-License-Identifier: Apache-2.0
deepspeed --num_gpus 2 examples/train_heterogeneous.py --deepspeed_config examples/configs/timeline.json \
    --steps 50 --profile hetero_profile
