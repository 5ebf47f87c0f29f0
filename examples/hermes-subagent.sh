#!/bin/sh
# Runs a Hermes agent as a wakebus subagent, one `hermes chat -q` per task:
#
#   wakebus worker --pool hermes --concurrency 4 --executor command -- \
#       sh examples/hermes-subagent.sh [HERMES_BIN]
#
# The command executor gives every task its request JSON on stdin and these
# variables: WAKEBUS_GOAL, WAKEBUS_CONTEXT (when under 64 KiB),
# WAKEBUS_DELEGATION_ID, WAKEBUS_TASK_INDEX, WAKEBUS_ORIGIN_SESSION,
# WAKEBUS_DEPTH, WAKEBUS_POOL, NATS_URL, WAKEBUS_PREFIX. Whatever Hermes
# prints becomes the task's summary; a nonzero exit marks it failed with the
# tail of stderr as the error. A subagent that delegates in turn
# (`wakebus delegate` inside it) nests one level deeper and is held to the
# depth limit.
set -eu
hermes="${1:-hermes}"
prompt="$WAKEBUS_GOAL"
if [ -n "${WAKEBUS_CONTEXT:-}" ]; then
    prompt="$prompt

Context:
$WAKEBUS_CONTEXT"
fi
echo '{"progress": "hermes started"}'
exec "$hermes" chat -q "$prompt"
