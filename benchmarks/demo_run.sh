#!/bin/sh
# The bundled demo (demos/demo-local-sgd.12ax.config) trained from scratch with the returnn_tpu of
# the checkout TREE, in a fresh folder /tmp/demo_<name of TREE>; its metrics.jsonl is copied to
# /tmp/metrics_<name>_<time>.jsonl. Two checkouts timed in turn, the ratio pair by pair:
#   git worktree add /tmp/before <commit>
#   farm-bench -n 3 --warmup 0 --timeout 1500 --vs "benchmarks/demo_run.sh /tmp/before" -- benchmarks/demo_run.sh .
set -e
TREE=$(cd "$1" && pwd)
NAME=$(basename "$TREE")
FOLDER=/tmp/demo_$NAME
rm -rf "$FOLDER" && mkdir "$FOLDER" && cd "$FOLDER"
export PYTHONPATH="$TREE" TF_CPP_MIN_LOG_LEVEL=2
python -m returnn_tpu.cli "$TREE/demos/demo-local-sgd.12ax.config" > "$FOLDER/out.log" 2>&1
cp "$FOLDER/returnn-tpu-demo/metrics.jsonl" "/tmp/metrics_${NAME}_$(date +%s%N).jsonl"
