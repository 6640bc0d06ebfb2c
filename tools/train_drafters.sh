#!/usr/bin/env bash
# Reproduce the shipped drafters (models/drafters): two families (eagle2, hass) x math-only, chat-only,
# mixed (equal total tokens) and mixed2 (double tokens), then the weight-space average of each family's
# math and chat specialists. Every run resumes from its checkpoint when rerun.
#   usage: tools/train_drafters.sh [TOKENS]   (default 500000 per specialist; about an hour on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-500000}
TAPS=${TAPS:-"python -m taps.train"}
common=(--tokens "$N" --batch-size 4 --quiet)
for fam in eagle2 hass; do
  $TAPS drafter --family "$fam" --data math "${common[@]}"
  $TAPS drafter --family "$fam" --data chat "${common[@]}"
done
for fam in eagle2 hass; do
  $TAPS drafter --family "$fam" --data mixed "${common[@]}"
  $TAPS drafter --family "$fam" --data mixed --name "$fam-mixed2" --tokens $((2 * N)) --batch-size 4 --quiet
  $TAPS average "models/drafters/$fam-math" "models/drafters/$fam-chat" --out "models/drafters/$fam-avg"
done
