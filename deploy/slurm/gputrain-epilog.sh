#!/bin/sh
# Slurm Epilog (runs as root on each node after a job ends): takes the job off the files
# gputrain-prolog.sh wrote, and removes a file that no job is left in. See gputrain-prolog.sh.
dir="${GPUTRAIN_SLURM_DIR:-/run/gputrain/slurm-gpus}"
[ -n "${SLURM_JOB_ID:-}" ] && [ -d "${dir}" ] || exit 0
for file in "${dir}"/*; do
    [ -f "${file}" ] || continue
    grep -vx -- "${SLURM_JOB_ID}" "${file}" > "${file}.tmp" || true
    if [ -s "${file}.tmp" ]; then
        mv -f "${file}.tmp" "${file}"
    else
        rm -f "${file}" "${file}.tmp"
    fi
done
exit 0
