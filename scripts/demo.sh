#!/usr/bin/env bash
# The main job: set-up from nothing (scripts/setup.sh), then the demo. Arguments go to the demo.
source "$(dirname "$0")/setup.sh"
"$PY" -m speedtorch_ops.demo "$@"
