#!/usr/bin/env bash
# CI: the subject of every commit CI tests is at most 72 characters (CONTRIBUTING.md, "Commits":
# what was run goes in the body). The commits checked are those reachable from HEAD and not from
# the cut-over commit below, the last commit made before the rule (older subjects are left as
# they are). A clone without the cut-over commit (a shallow clone) checks HEAD's subject only,
# and says so.
#   bash .ci/commit_subjects.sh          check the commits since the cut-over
#   bash .ci/commit_subjects.sh BASE     check the commits since BASE instead
set -euo pipefail
cd "$(dirname "$0")/.."
cutover=83c81eaf3e3d4c227e73844ed1aa0d58191a6e9a
limit=72
base=${1:-$cutover}

if ! git rev-parse --verify --quiet "$base^{commit}" >/dev/null; then
  echo "commit subjects: $base is not in this clone (shallow?): checking HEAD only"
  range=(-1 HEAD)
else
  range=("$base..HEAD")
fi

bad=0
count=0
while IFS= read -r line; do
  count=$((count + 1))
  hash=${line%% *}
  subject=${line#* }
  if [ "${#subject}" -gt "$limit" ]; then
    echo "$hash: subject of ${#subject} characters (at most $limit): $subject"
    bad=$((bad + 1))
  fi
done < <(git log --format='%h %s' "${range[@]}")

if [ "$bad" -ne 0 ]; then
  echo "commit subjects: $bad of $count over $limit characters" >&2
  exit 1
fi
echo "commit subjects: $count checked, none over $limit characters"
