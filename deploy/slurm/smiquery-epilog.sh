#!/bin/bash
# smiquery-epilog.sh: append a Slurm job's GPU summary to its output, at job end, from Prometheus.
#
# The summary is `smiquery report --prometheus URL --slurm-job ID --format summary`: per GPU mean and peak
# utilization, memory peak against total, energy, time stalled, and one line of advice. It reads what
# `smiquery export --slurm` wrote to Prometheus (docs/slurm.md).
#
# Environment (Slurm sets SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GID; EpilogSlurmctld also SLURM_JOB_STDOUT):
#   SMIQUERY_PROMETHEUS      the Prometheus URL (required)
#   SMIQUERY                 the smiquery executable (default: smiquery on PATH; Slurm runs epilogs with no PATH)
#   SMIQUERY_EPILOG_OUTPUT   where to append: a file, "job" for the job's standard output ($SLURM_JOB_STDOUT),
#                            or unset/"-" for this script's standard output
#   SMIQUERY_HTTP_CONFIG     credentials and TLS for Prometheus (promtool's http config file), optional
#   SMIQUERY_EPILOG_WAIT     seconds to wait first, so the last scrape of the job reaches Prometheus (default 0)
#
# Run as root (Epilog, or EpilogSlurmctld with SlurmctldUser=root), the append is done as the job's own user
# (setpriv), so a job cannot make root write through a link. Nothing the job controls is evaluated: the job id
# must be digits (an array task's 123_4 too), every value is passed as one quoted argument.
# It always exits 0: a failing epilog would drain the node; errors go to stderr (slurmd's log).

set -u
PATH=/usr/local/bin:/usr/bin:/bin

log() { printf 'smiquery-epilog: %s\n' "$*" >&2; }

job=${SLURM_JOB_ID:-}
if [[ ! $job =~ ^[0-9]+(_[0-9]+)?$ ]]; then
    log "SLURM_JOB_ID is not a job id; nothing written"
    exit 0
fi
url=${SMIQUERY_PROMETHEUS:-}
if [[ -z $url ]]; then
    log "set SMIQUERY_PROMETHEUS to the Prometheus URL; nothing written for job $job"
    exit 0
fi
smiquery=${SMIQUERY:-smiquery}
wait_s=${SMIQUERY_EPILOG_WAIT:-0}
if [[ $wait_s =~ ^[0-9]+$ ]] && ((wait_s > 0)); then
    sleep "$wait_s"
fi

args=(report --prometheus "$url" --slurm-job "$job" --format summary)
if [[ -n ${SMIQUERY_HTTP_CONFIG:-} ]]; then
    args+=(--http-config "$SMIQUERY_HTTP_CONFIG")
fi

out=${SMIQUERY_EPILOG_OUTPUT:--}
if [[ $out == job ]]; then
    out=${SLURM_JOB_STDOUT:-}
    if [[ -z $out ]]; then
        log "SLURM_JOB_STDOUT is not set (it is in EpilogSlurmctld); nothing written for job $job"
        exit 0
    fi
fi

if ! summary=$("$smiquery" "${args[@]}"); then
    log "no GPU summary for job $job (smiquery failed; see above)"
    exit 0
fi

if [[ $out == - ]]; then
    printf '%s\n' "$summary"
    exit 0
fi

# the append itself: as the job's user when running as root
as_user=()
if [[ $(id -u) == 0 && ${SLURM_JOB_UID:-} =~ ^[0-9]+$ && ${SLURM_JOB_UID} != 0 ]]; then
    gid=${SLURM_JOB_GID:-$SLURM_JOB_UID}
    [[ $gid =~ ^[0-9]+$ ]] || gid=$SLURM_JOB_UID
    as_user=(setpriv --reuid "$SLURM_JOB_UID" --regid "$gid" --clear-groups --)
fi
if ! printf '\n%s\n' "$summary" | "${as_user[@]}" tee -a -- "$out" >/dev/null; then
    log "could not append the GPU summary of job $job to the output file"
fi
exit 0
