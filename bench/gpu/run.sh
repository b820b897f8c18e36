#!/usr/bin/env bash
# The project's GPU check in one command (bench/gpu/run.py says what each stage does):
#
#   bench/gpu/run.sh correctness,train_speed --deadline_s 350
#   bench/gpu/run.sh bible,oom,decode_speed --deadline_s 350
#   bench/gpu/run.sh all --dry_run            # on a CPU: every stage, tiny
#
# Results go to $OUT (else bench/results/gpu): run.json, one JSON per stage, log.txt.
# Carry .whl (bench/gpu/fetch_wheels.sh) and data/bible (python -m seq2seq.data.bible
# data/bible) to a machine that lacks them.
set -u
cd "$(dirname "$0")/../.." || exit 2
exec "${PYTHON:-python3}" -u bench/gpu/run.py "$@"
