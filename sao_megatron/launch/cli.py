"""`sao-megatron launch --config X.yaml --nodes-train N --nodes-rollout M [...]`: submit with submitit.

Checks everything it can before submitting (plan, config, run directory, engine weights,
partition size) so that mistakes fail here with a message rather than inside the job.
"""

from __future__ import annotations

import argparse
import re
import sys

_TIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d{1,2})(?::(\d{1,2}))?$")


def parse_time_min(text: str) -> int:
    """Minutes from ``90``, ``1:30:00`` (H:MM:SS), ``1:30`` (H:MM) or ``2-00:00:00`` (D-HH:MM:SS)."""
    if text.isdigit():
        return int(text)
    m = _TIME.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"--time {text!r}: use minutes (90), H:MM[:SS] or D-HH:MM:SS")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from sao_megatron.launch.node import add_plan_args

    p = sub.add_parser("launch", help="submit the trainer + rollout layout to Slurm (submitit)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p)
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    p.add_argument("--time", dest="time_min", type=parse_time_min, default=60,
                   help="time limit per run: minutes or H:MM:SS (default 60); requeued runs get it again")
    p.add_argument("--job-name", default="sao-megatron", help="Slurm job name")
    p.add_argument("--container-image", default=None, help="pyxis/enroot image for the job's steps")
    p.add_argument("--container-mounts", default=None, help="pyxis --container-mounts (default: cwd and run dir)")
    p.add_argument("--signal-lead", dest="signal_lead_s", type=int, default=120,
                   help="seconds before the time limit at which the trainer checkpoints (default 120)")
    p.add_argument("--max-requeues", type=int, default=10, help="time-limit requeues before giving up")
    p.add_argument("--dry-run", action="store_true", help="validate and print the sbatch script; submit nothing")
    p.add_argument("--wait", action="store_true", help="block until the job finishes; exit with its status")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sao_megatron.launch import submit as sb
    from sao_megatron.launch.node import plan_from_args
    from sao_megatron.launch.slurm_query import SlurmUnavailable

    plan = plan_from_args(args, partition=args.partition, time_min=args.time_min, job_name=args.job_name,
                          container_image=args.container_image, container_mounts=args.container_mounts,
                          signal_lead_s=args.signal_lead_s, max_requeues=args.max_requeues)
    try:
        partition = sb.validate(plan, query_cluster=True)
    except SlurmUnavailable as exc:
        if not args.dry_run:
            sys.stderr.write(f"sao-megatron launch: error: cannot submit: {exc}\n")
            return 2
        sys.stderr.write(f"sao-megatron launch: note: partition size not checked ({exc})\n")
        partition = None
    except ValueError as exc:  # includes ConfigError: bad input, nothing was submitted
        sys.stderr.write(f"sao-megatron launch: error: {exc}\n")
        return 2
    if args.dry_run:
        cpus = partition.cpus_per_node if partition else None
        sys.stdout.write(sb.render_sbatch(plan, cpus, "python" if plan.container_image else sys.executable))
        return 0
    job = sb.submit(plan, partition)
    sys.stdout.write(f"submitted job {job.job_id}\n"
                     f"  run dir:      {plan.run_dir}\n"
                     f"  job log:      {job.paths.stdout}  (stderr: {job.paths.stderr})\n"
                     f"  node logs:    {sb.submitit_folder(plan) / job.job_id}/{job.job_id}_<task>_log.out "
                     f"(task = node index; trainer nodes first)\n"
                     f"  metrics:      {plan.run_dir}/metrics.jsonl (checkpoints in {plan.run_dir}/checkpoints)\n")
    sys.stdout.flush()
    if not args.wait:
        return 0
    try:
        sb.wait_for(job)
    except Exception as exc:  # submitit re-raises the job's failure
        sys.stderr.write(f"job {job.job_id} failed: {exc}\n")
        return 1
    sys.stdout.write(f"job {job.job_id} finished\n")
    return 0
