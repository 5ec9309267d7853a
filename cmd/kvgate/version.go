package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// Set at link time (go build -ldflags "-X main.version=v1.2.0 -X
// main.commit=... -X main.date=..."): the Makefile sets version from git
// describe; a build without the repository's .git (the Dockerfile's) has no
// VCS stamp and passes all three. Empty, each falls back to what the Go
// toolchain stamped into the binary (runtime/debug.ReadBuildInfo).
var version, commit, date string

// buildInfo is what `kvgate version` prints.
type buildInfo struct {
	Version  string `json:"version"`
	Go       string `json:"go"`
	Platform string `json:"platform"`
	Commit   string `json:"commit"`
	// Date is the commit's time (vcs.time), or the one given at link time.
	Date string `json:"date"`
	// Modified: the tree had uncommitted changes (vcs.modified).
	Modified bool `json:"modified"`
}

// currentBuild is this binary's build information.
func currentBuild() buildInfo {
	bi, _ := debug.ReadBuildInfo()
	return describeBuild(bi, version, commit, date)
}

// describeBuild merges the toolchain's stamp (bi, nil when the binary has
// none) with the link-time values, which win when set.
func describeBuild(bi *debug.BuildInfo, ver, rev, when string) buildInfo {
	b := buildInfo{Version: "(devel)", Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH,
		Commit: "unknown", Date: "unknown"}
	if bi != nil {
		b.Go = bi.GoVersion
		// go build in a module sets a pseudo-version from the VCS
		// (v0.0.0-DATE-REV+dirty); go install module@vX sets vX.
		if bi.Main.Version != "" {
			b.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				b.Commit = s.Value
			case "vcs.time":
				b.Date = s.Value
			case "vcs.modified":
				b.Modified = s.Value == "true"
			}
		}
	}
	for _, o := range []struct {
		val string
		dst *string
	}{{ver, &b.Version}, {rev, &b.Commit}, {when, &b.Date}} {
		if o.val != "" {
			*o.dst = o.val
		}
	}
	return b
}

// write prints b: one line for people, or JSON for scripts.
func (b buildInfo) write(w io.Writer, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(b)
	}
	mod := ""
	if b.Modified {
		mod = " (modified)"
	}
	_, err := fmt.Fprintf(w, "kvgate %s\n  commit: %s%s\n  date:   %s\n  go:     %s %s\n", b.Version, b.Commit, mod, b.Date, b.Go, b.Platform)
	return err
}

// versionFlags are the flags of `kvgate version`.
type versionFlags struct{ json bool }

func (f *versionFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.json, "json", false, "print the build information as JSON")
}

func (f *versionFlags) run(_ context.Context, inv invocation) error {
	return currentBuild().write(inv.stdout, f.json)
}
