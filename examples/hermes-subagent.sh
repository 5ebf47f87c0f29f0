#!/bin/sh
# Runs a Hermes agent as a wakebus subagent, one `hermes chat -q` per task:
#
#   wakebus worker --pool hermes --concurrency 4 --executor command -- \
#       sh examples/hermes-subagent.sh [HERMES_BIN]
#
# The command executor gives every task its request JSON on stdin and these
# variables: WAKEBUS_GOAL and WAKEBUS_CONTEXT (each only when at most 64 KiB
# and free of NUL characters), WAKEBUS_DELEGATION_ID, WAKEBUS_TASK_INDEX,
# WAKEBUS_ORIGIN_SESSION, WAKEBUS_DEPTH, WAKEBUS_POOL, NATS_URL,
# WAKEBUS_PREFIX. A goal or context too large for a variable (or for one
# command-line argument) is written to a file the prompt points Hermes to:
# that needs `jq`, and a Hermes toolset that can read files. Whatever Hermes prints becomes the task's summary (a JSON
# object, the answer to a request's output_schema, is kept whole); a nonzero
# exit marks it failed with the tail of stderr as the error. A subagent that
# delegates in turn (`wakebus delegate` inside it) nests one level deeper and
# is held to the depth limit.
set -eu
hermes="${1:-hermes}"

# Files for this run, removed when it ends (a stop's SIGTERM included: an
# untrapped signal would skip the EXIT trap).
dir="$(mktemp -d "${TMPDIR:-/tmp}/wakebus-${WAKEBUS_DELEGATION_ID:-task}.XXXXXX")"
trap 'rm -rf "$dir"' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP
new_file() {
    file="$dir/$1"
}

# What the variables could not carry comes from the request on stdin.
if [ -z "${WAKEBUS_GOAL+set}" ] || [ -z "${WAKEBUS_CONTEXT+set}" ]; then
    new_file request
    request="$file"
    cat > "$request"
fi

if [ -n "${WAKEBUS_GOAL+set}" ]; then
    prompt="$WAKEBUS_GOAL"
else
    new_file goal
    jq -j .goal "$request" > "$file"
    prompt="Your task is in the file $file; read it first."
fi
# One command-line argument holds at most 128 KiB: a context that would not
# fit beside the goal goes to a file too.
bytes() { printf %s "$1" | LC_ALL=C wc -c; }
if [ -n "${WAKEBUS_CONTEXT+set}" ] && [ $(($(bytes "$prompt") + $(bytes "$WAKEBUS_CONTEXT"))) -gt 100000 ]; then
    new_file context
    printf '%s' "$WAKEBUS_CONTEXT" > "$file"
    unset WAKEBUS_CONTEXT
elif [ -z "${WAKEBUS_CONTEXT+set}" ]; then
    new_file context
    jq -j .context "$request" > "$file"
fi
if [ -n "${WAKEBUS_CONTEXT+set}" ]; then
    if [ -n "$WAKEBUS_CONTEXT" ]; then
        prompt="$prompt

Context:
$WAKEBUS_CONTEXT"
    fi
else
    prompt="$prompt

Context: in the file $file ($(wc -c < "$file") bytes); read it."
fi
echo '{"progress": "hermes started"}'
"$hermes" chat -q "$prompt"
