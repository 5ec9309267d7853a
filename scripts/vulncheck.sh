#!/usr/bin/env bash
# vulncheck.sh: govulncheck (pinned) over the module and the toolchain, as make check runs it.
#
# A known vulnerability reachable from kvgate's code fails (govulncheck's exit status 3), as does
# any other error of govulncheck. Two things the network must provide are not the code's fault,
# and without them the check says plainly that it SKIPPED and exits 0, so that make check does
# not fail offline:
#   - govulncheck itself, built by `go run` from the module proxy (or the module cache);
#   - its vulnerability database, VULNDB (https://vuln.go.dev by default), asked first with a
#     10-second timeout; a fetch error of govulncheck itself is read the same way.
#
# Environment:
#   GO                   go command (default: go)
#   GOVULNCHECK_VERSION  golang.org/x/vuln version (default: v1.9.0)
#   VULNDB               database URL, or file:///DIR for a local copy (default: https://vuln.go.dev)
set -uo pipefail

GO=${GO:-go}
tool="golang.org/x/vuln/cmd/govulncheck@${GOVULNCHECK_VERSION:-v1.9.0}"
db=${VULNDB:-https://vuln.go.dev}

skip() {
	echo "vulncheck: SKIPPED (not a pass): $*"
	exit 0
}

if ! out=$("$GO" run "$tool" -version 2>&1); then
	skip "cannot build $tool (module proxy unreachable?): $(tail -n 1 <<<"$out")"
fi

case $db in
http://* | https://*)
	if command -v curl >/dev/null && ! err=$(curl -fsS -m 10 -o /dev/null "$db/index/db.json.gz" 2>&1); then
		skip "vulnerability database $db unreachable: $err"
	fi
	;;
esac

out=$("$GO" run "$tool" -db "$db" ./... 2>&1)
rc=$?
if [ "$rc" -ne 0 ] && grep -q '^govulncheck: fetching vulnerabilities:' <<<"$out"; then
	skip "vulnerability database $db unreachable: $(grep -m 1 '^govulncheck: fetching' <<<"$out")"
fi
echo "$out"
exit "$rc"
