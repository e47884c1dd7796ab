#!/bin/bash
# One SLURM task's rank, restarted in place when it fails:  retry_task.sh COMMAND [ARGS...]
#
# SLURM does not restart one task of a job step, so the task restarts its own rank: a failed
# attempt is run again, up to RETRIES times (default 2). The new process says hello as that
# rank, and the coordinator, whose run is still going, admits it as the rank's next incarnation
# once it has declared the old one dead (at once when its connection dropped; after the
# heartbeat timeout when its node vanished) and handed its unfinished work to the others.
# FLODL_RESTART_COUNT=<attempt> (0 on the first) is exported for the script, as `flodl launch
# --respawn` sets it on a restart; flodl itself does not need it. Exits 0 as soon as an attempt
# does, else with the last attempt's status.
#
#   srun --kill-on-bad-exit=0 examples/slurm/retry_task.sh python3 train.py
retries=${RETRIES:-2}
code=0
for attempt in $(seq 0 "$retries"); do
    export FLODL_RESTART_COUNT=$attempt
    "$@" && exit 0
    code=$?
    echo "flodl task ${SLURM_PROCID:-?}: attempt $attempt exited $code" >&2
done
exit "$code"
