package main

import (
	"encoding/json"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

// The toolchain's VCS stamp fills the build information; link-time values
// (-ldflags -X main.version=...) win over it.
func TestDescribeBuild(t *testing.T) {
	stamped := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-20261127-abc+dirty"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.time", Value: "2026-11-27T02:00:00Z"},
			{Key: "vcs.modified", Value: "true"}, {Key: "GOARCH", Value: "amd64"}}}
	for _, tc := range []struct {
		name                string
		bi                  *debug.BuildInfo
		ver, rev, when      string
		wantVer, wantCommit string
		wantDate            string
		wantModified        bool
	}{
		{"no stamp", nil, "", "", "", "(devel)", "unknown", "unknown", false},
		{"stamped", stamped, "", "", "", "v0.0.0-20261127-abc+dirty", "abc123", "2026-11-27T02:00:00Z", true},
		{"link-time version", stamped, "v1.2.0-3-gabc123-dirty", "", "", "v1.2.0-3-gabc123-dirty", "abc123", "2026-11-27T02:00:00Z", true},
		{"no vcs, all at link time", &debug.BuildInfo{GoVersion: "go1.26.8"}, "v1.2.0", "def456", "2026-11-01T00:00:00Z",
			"v1.2.0", "def456", "2026-11-01T00:00:00Z", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := describeBuild(tc.bi, tc.ver, tc.rev, tc.when)
			if b.Version != tc.wantVer || b.Commit != tc.wantCommit || b.Date != tc.wantDate || b.Modified != tc.wantModified {
				t.Fatalf("%+v", b)
			}
			if b.Go == "" || b.Platform != runtime.GOOS+"/"+runtime.GOARCH {
				t.Fatalf("go %q platform %q", b.Go, b.Platform)
			}
			var out strings.Builder
			if err := b.write(&out, false); err != nil {
				t.Fatal(err)
			}
			for _, want := range []string{"kvgate " + tc.wantVer + "\n", "commit: " + tc.wantCommit, "date:   " + tc.wantDate, b.Go} {
				if !strings.Contains(out.String(), want) {
					t.Fatalf("%q lacks %q", out.String(), want)
				}
			}
			if strings.Contains(out.String(), "(modified)") != tc.wantModified {
				t.Fatalf("modified %v: %q", tc.wantModified, out.String())
			}
		})
	}
}

// `kvgate version`, `kvgate --version` and `kvgate version --json` print
// this binary's build; --help lists the verb.
func TestVersionVerb(t *testing.T) {
	code, out, errs := runCmd(t, "", "version")
	if code != 0 || errs != "" || !strings.HasPrefix(out, "kvgate ") || !strings.Contains(out, runtime.Version()) {
		t.Fatalf("version: %d %q %q", code, out, errs)
	}
	if code, flagOut, _ := runCmd(t, "", "--version"); code != 0 || flagOut != out {
		t.Fatalf("--version: %d %q, want %q", code, flagOut, out)
	}
	code, js, _ := runCmd(t, "", "--version", "--json")
	var b buildInfo
	if err := json.Unmarshal([]byte(js), &b); code != 0 || err != nil {
		t.Fatalf("--version --json: %d %v %q", code, err, js)
	}
	if b != currentBuild() || b.Go != runtime.Version() {
		t.Fatalf("json %+v, want %+v", b, currentBuild())
	}
	if code, _, errs := runCmd(t, "", "version", "extra"); code != 2 || !strings.Contains(errs, "unexpected argument") {
		t.Fatalf("version extra: %d %q", code, errs)
	}
	if code, help, _ := runCmd(t, "", "--help"); code != 0 || !strings.Contains(help, "\n  version ") {
		t.Fatalf("--help does not list version: %q", help)
	}
}
