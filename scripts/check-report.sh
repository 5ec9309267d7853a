#!/usr/bin/env bash
# check-report.sh: render a kvgate HTML report in headless Chromium and check that it
# actually renders: the DOM Chromium parsed holds the results table and the charts, and
# a screenshot comes out.
#
# Usage:
#   go build -o bin/kvgate ./cmd/kvgate
#   bin/kvgate demo --report /tmp/demo-report        # or: bin/kvgate bench ... --report DIR
#   scripts/check-report.sh /tmp/demo-report [OUTDIR]
#
# REPORT_DIR is the directory holding index.html. OUTDIR (default: a new temp dir) receives
# screenshot.png, dom.html (the DOM as Chromium parsed it), dom-elements.html (the same
# without comments/script/style text, which is what the checks count in) and chromium.log;
# their paths are printed so the screenshot can be looked at.
#
# Environment:
#   CHROMIUM      browser binary to use (default: first of chromium, chromium-browser,
#                 google-chrome, google-chrome-stable, headless_shell on PATH)
#   WINDOW_SIZE   viewport for the screenshot, W,H (default 1400,3000)
#   TIMEOUT       seconds allowed per Chromium run (default 60)
#
# Exit status: 0 when the report renders (or Chromium is not installed: prints SKIP),
# 1 when a check fails, 2 on bad usage.
#
# Why these checks: a report that Go wrote correctly can still fail in a browser (markup
# the parser drops, an SVG that is not well formed, a page that never finishes loading),
# and only a real browser shows that. Network stays off: the page is opened as file://,
# every host name resolves to nothing, and Chromium's own background traffic is disabled,
# so the screenshot shows the page as a reader offline sees it and nothing remote can stall
# the check. The report is meant to be self-contained, so a remote script, stylesheet,
# image or frame in it fails the check too (plain <a href> links are fine).
set -euo pipefail

usage() {
	echo "usage: $0 REPORT_DIR [OUTDIR]" >&2
	exit 2
}

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

[[ $# -ge 1 && $# -le 2 ]] || usage
dir=$1
[[ -d $dir ]] || fail "$dir is not a directory"
index=$(cd "$dir" && pwd)/index.html
[[ -s $index ]] || fail "$index is missing or empty"

browser=${CHROMIUM:-}
if [[ -z $browser ]]; then
	for b in chromium chromium-browser google-chrome google-chrome-stable headless_shell; do
		if command -v "$b" >/dev/null 2>&1; then
			browser=$(command -v "$b")
			break
		fi
	done
fi
if [[ -z $browser ]] || ! command -v "$browser" >/dev/null 2>&1; then
	echo "SKIP: chromium not installed (apt-get install chromium)"
	exit 0
fi

out=${2:-$(mktemp -d "${TMPDIR:-/tmp}/check-report.XXXXXX")}
mkdir -p "$out"
shot=$out/screenshot.png
dom=$out/dom.html
log=$out/chromium.log
rm -f "$shot" "$dom"
: >"$log"

window=${WINDOW_SIZE:-1400,3000}
limit=${TIMEOUT:-60}

# Each run gets its own throw-away profile so that nothing from an earlier run (cache,
# crashed-session state) changes what is rendered, and so that two checks can run at once.
profiles=()
cleanup() {
	local p
	for p in "${profiles[@]}"; do
		rm -rf "$p"
	done
}
trap cleanup EXIT

# run_chromium MODE_FLAG...: one headless run over index.html; stdout is the caller's.
run_chromium() {
	local profile
	profile=$(mktemp -d "${TMPDIR:-/tmp}/check-report-profile.XXXXXX")
	profiles+=("$profile")
	# --no-sandbox: Chromium refuses to start as root without it, and containers often lack
	# the user namespaces its sandbox needs; the page is our own local file.
	# --host-resolver-rules: no name resolves, so nothing remote can load (file:// only).
	timeout -k 5 "$limit" "$browser" \
		--headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
		--disable-quic --no-first-run --no-default-browser-check \
		--disable-background-networking --disable-component-update --disable-sync \
		--disable-default-apps --disable-extensions --disable-crash-reporter \
		--host-resolver-rules='MAP * ~NOTFOUND' \
		--user-data-dir="$profile" --window-size="$window" \
		"$@" "file://$index" 2>>"$log"
}

echo "chromium: $browser ($("$browser" --version 2>/dev/null | head -n1 || true))"
echo "report:   $index"

# chromium_failed WHAT RC: explain a failed run; the D-Bus complaints of a headless
# browser in a container are noise and left out of the excerpt.
chromium_failed() {
	grep -v -e 'dbus' -e '^$' "$log" | tail -n 10 >&2 || true
	if [[ $2 -eq 124 || $2 -eq 137 ]]; then
		fail "chromium $1 did not finish within ${limit}s (log: $log)"
	fi
	fail "chromium $1 exited with status $2 (log: $log)"
}

rc=0
run_chromium --dump-dom >"$dom" || rc=$?
[[ $rc -eq 0 ]] || chromium_failed --dump-dom "$rc"
run_chromium --hide-scrollbars --screenshot="$shot" >>"$log" || rc=$?
[[ $rc -eq 0 ]] || chromium_failed --screenshot "$rc"

# The checks read the DOM as Chromium serialised it, so they see what the parser kept,
# not what Go wrote. The serialiser writes comments and the contents of script, style and
# noscript elements verbatim, so markup inside them (say a chart swallowed by a comment
# that was never closed) would still look like elements: strip those first.
# grep -o counts occurrences, not lines.
elements=$out/dom-elements.html
if command -v perl >/dev/null 2>&1; then
	perl -0777 -pe 's/<!--.*?(-->|\z)//gs; s/<(script|style|noscript)\b[^>]*>.*?<\/\1\s*>//gis' "$dom" >"$elements"
else
	echo "warning: perl not found; counting in the raw DOM, comments included" >&2
	cp "$dom" "$elements"
fi
count() { { grep -o -i -- "$1" "$elements" || true; } | wc -l; }

errors=()
tables=$(count '<table[^>]*class="[^"]*results')
rows=$(count '<tr[ >]')
svgs=$(count '<svg[ >]')
[[ $tables -ge 1 ]] || errors+=('no results table (<table class="results">) in the rendered DOM')
# A header row plus at least one policy row.
[[ $rows -ge 2 ]] || errors+=("results table has $rows rows, want a header and at least one data row")
remote=$({ grep -o -i -E -- '<(script|img|iframe|link|source|embed|object|image|use)\b[^>]*(src|href|data)="(https?:)?//[^"]*"' "$elements" || true; } | head -n 3)
[[ -z $remote ]] || errors+=("the page loads remote resources (it must be self-contained): ${remote//$'\n'/ ; }")
[[ $svgs -ge 3 ]] || errors+=("$svgs <svg> elements in the rendered DOM, want at least 3 (ttft cdf, hit rate over time, replica share)")
if [[ ! -s $shot ]]; then
	errors+=("screenshot $shot is missing or empty")
elif [[ $(head -c 8 "$shot" | od -An -tx1 | tr -d ' \n') != 89504e470d0a1a0a ]]; then
	errors+=("screenshot $shot is not a PNG")
fi

echo "dom:      $dom ($(wc -c <"$dom") bytes): $tables results table, $rows table rows, $svgs <svg> elements"
echo "shot:     $shot ($(wc -c <"$shot" 2>/dev/null || echo 0) bytes, window $window)"
if [[ ${#errors[@]} -gt 0 ]]; then
	for e in "${errors[@]}"; do
		echo "FAIL: $e" >&2
	done
	echo "chromium log: $log" >&2
	exit 1
fi
echo "OK: report renders"
