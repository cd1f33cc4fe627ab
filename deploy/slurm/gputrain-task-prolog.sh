#!/bin/sh
# Slurm TaskProlog for gputrain-exporter: names each task's run after its job, so every rank of
# a job, on every node, reports under one run. In slurm.conf:
#   TaskProlog=/etc/slurm/gputrain-task-prolog.sh
# Slurm sets in the task's environment each "export NAME=value" line this prints.
# The exporter itself runs on every node under systemd (deploy/systemd); tasks push to it on
# 127.0.0.1:19401, the client's default.
run="${SLURM_JOB_ID}"
if [ -n "${SLURM_ARRAY_JOB_ID}" ] && [ -n "${SLURM_ARRAY_TASK_ID}" ]; then
    run="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"  # one run per array task
fi
[ -n "${run}" ] && echo "export GPUTRAIN_RUN=${run}"
# The rank needs nothing: the client takes RANK (torchrun's global rank) and else SLURM_PROCID.
# `gputrain-exporter profile --stacks`: py-spy runs as the task's own child, which Yama's
# ptrace_scope 0 or 1 allows with no privilege; at 2 or 3 it cannot attach, and each task is
# told why in its output (docs/profiles.md, "Where py-spy runs").
scope="$(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 0)"
case "${scope}" in
    2|3) echo "print gputrain: kernel.yama.ptrace_scope is ${scope} on this node: py-spy" \
              "stacks (profile --stacks) cannot attach to this task; scope 1 allows it" ;;
esac
exit 0
