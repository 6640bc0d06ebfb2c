#!/usr/bin/env bash
# Reproduce the shipped drafters (models/drafters): three families (eagle2, hass, eagle3) x math-only,
# chat-only, mixed (equal total tokens) and mixed2 (double tokens), then the weight-space average of each
# family's math and chat specialists. Every run resumes from its checkpoint when rerun.
#   usage: [FAMILIES="eagle3"] tools/train_drafters.sh [TOKENS [extra taps train drafter options]]
#   (default 500000 tokens per specialist; eagle2 + hass about an hour on 2 CPU cores, eagle3 about 2 hours)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-500000}
shift || true
TAPS=${TAPS:-"python -m taps.train"}
FAMILIES=${FAMILIES:-"eagle2 hass eagle3"}
common=(--tokens "$N" --batch-size 4 --quiet "$@")
for fam in $FAMILIES; do
  $TAPS drafter --family "$fam" --data math "${common[@]}"
  $TAPS drafter --family "$fam" --data chat "${common[@]}"
done
for fam in $FAMILIES; do
  $TAPS drafter --family "$fam" --data mixed "${common[@]}"
  $TAPS drafter --family "$fam" --data mixed --name "$fam-mixed2" "${common[@]}" --tokens $((2 * N))
  $TAPS average "models/drafters/$fam-math" "models/drafters/$fam-chat" --out "models/drafters/$fam-avg"
done
