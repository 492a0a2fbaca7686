deepspeed env_report --heterogeneous                 # or: ds_report --heterogeneous
deepspeed env_report --heterogeneous --config examples/configs/seed.json
