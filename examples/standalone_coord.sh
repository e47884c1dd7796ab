#!/usr/bin/env bash
# Tier 4: ranks started by another launcher (here torchrun) join a standalone coordinator;
# the ranks bring the job (dataset, batch size, epochs, mode), so the coordinator needs only
# the world size and the secret.
# Run from the repository root:  bash examples/standalone_coord.sh
set -euo pipefail
secret_dir=$(mktemp -d)
trap 'kill "$coord_pid" 2>/dev/null || true; rm -rf "$secret_dir"' EXIT
flodl coord --world-size 2 \
    --secret-file "$secret_dir/secret" > "$secret_dir/coord.log" &
coord_pid=$!
for _ in $(seq 100); do grep -q FLODL_COORD= "$secret_dir/coord.log" 2>/dev/null && break; sleep 0.1; done
address=$(grep -o 'FLODL_COORD=[^ ]*' "$secret_dir/coord.log" | cut -d= -f2)
run_id=$(grep -o 'FLODL_RUN_ID=[^ ]*' "$secret_dir/coord.log" | cut -d= -f2)
FLODL_COORD=$address FLODL_SECRET_FILE=$secret_dir/secret FLODL_RUN_ID=$run_id \
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
    examples/join_coordinator.py --mode cpu_cadence --epochs 3
wait "$coord_pid"
