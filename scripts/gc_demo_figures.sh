#!/usr/bin/env bash
# Reproduces the gc figures of docs/retention.md: one `deltasync demo` run (its defaults: 400 steps
# of the 0.4M-parameter toy Qwen3) into a fresh local store, then `deltasync gc --keep-anchors 2`.
# Prints the store's size, step and anchor counts before and after. Usage: scripts/gc_demo_figures.sh [PORT]
set -euo pipefail
port="${1:-7861}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
store="$work/run"
deltasync demo --store "$store" --host 127.0.0.1 --port "$port" --no-browser --exit-when-done >"$work/demo.log" 2>&1
count() { find "$store/steps" -name manifest.json | wc -l; }
anchors() { grep -l '"kind": *"anchor"' "$store"/steps/*/manifest.json | wc -l; }
echo "before: $(du -sb "$store" | cut -f1) bytes, $(count) steps, $(anchors) anchors"
deltasync gc "$store" --keep-anchors 2 | grep -v "^  "
echo "after:  $(du -sb "$store" | cut -f1) bytes, $(count) steps, $(anchors) anchors"
