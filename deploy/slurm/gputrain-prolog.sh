#!/bin/sh
# Slurm Prolog (runs as root on each node before a job starts) for gputrain-exporter's
# --collector.slurm: appends the job's id to a file per GPU it was given, so the exporter can
# say which job holds each GPU (gputrain_gpu_job_info), client or not. In slurm.conf:
#   Prolog=/etc/slurm/gputrain-prolog.sh
#   Epilog=/etc/slurm/gputrain-epilog.sh
# and run the exporter with --collector.slurm (it reads /run/gputrain/slurm-gpus by default;
# GPUTRAIN_SLURM_DIR here and --slurm.job-mapping-dir there change it together).
dir="${GPUTRAIN_SLURM_DIR:-/run/gputrain/slurm-gpus}"
gpus="${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}"
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${gpus}" ] || exit 0
mkdir -p "${dir}" && chmod 0755 "${dir}"
for gpu in $(echo "${gpus}" | tr ',' ' '); do
    case "${gpu}" in
        *[!A-Za-z0-9_-]*) continue ;;  # an index or a GPU-/MIG- UUID, nothing else
    esac
    echo "${SLURM_JOB_ID}" >> "${dir}/${gpu}"
    chmod 0644 "${dir}/${gpu}"
done
exit 0  # never fail the job for monitoring
