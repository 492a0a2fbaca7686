# SPDX-License-Identifier: Apache-2.0
"""deepspeed-hetero's autotuner (``deepspeed --autotuning tune|run``).

Modules, pure logic first:
  settings     the autotuning block's settings and the ds_config keys the tuner reads
  space        the tuning space read from the user's ds_config (pipeline degree and partition
               included)
  experiment   one point of the space and its ds_config; the optimal ds_config
  costmodel    per-rank time and memory models from one profiling run; predictions
  results      metric selection, failure classification, summary table, learning-rate advice
  experiments  engine side: times a window of optimizer steps, gathers every rank, writes JSON
  runner       one experiment = one ``deepspeed`` launcher process group, with a time-out
  search       the profiling run, the candidates and the strategies (fast, gridsearch, random,
               model_based)
  outputs      progress lines, results_dir's files, the optimal ds_config and command, the report
  tuner        ``deepspeed --autotuning tune|run``: checks before launch, the experiment loop
"""
