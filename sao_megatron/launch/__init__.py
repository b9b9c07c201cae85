"""Launching the trainer + rollout layout on Slurm (sbatch scripts in ``slurm/`` and submitit).

``plan``: the submit-time description of a run (node counts, GPUs, engines) and the pure
functions that turn it into per-node commands (torchrun, engine servers, router).
``node``: what runs on one node of the allocation (``python -m sao_megatron.launch.node``),
shared by the sbatch script and the submitit job. ``train_entry``: what torchrun runs (wait
for the engines, then ``sao-megatron train``). ``engine_init``: the weights engines start
from. ``submit``: the submitit launcher behind ``sao-megatron launch``. ``slurm_query``:
sinfo/scontrol look-ups and submit-time checks.
"""
