package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct {
	line      int
	cmd, args string // cmd upper-cased
}

// readDockerfile returns the instructions of the repository's Dockerfile.
func readDockerfile(t *testing.T) []instruction {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot(t), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []instruction
	var cur strings.Builder
	start := 0
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if cur.Len() == 0 && (line == "" || strings.HasPrefix(line, "#")) {
			continue // a comment or a parser directive (# syntax=)
		}
		if cur.Len() == 0 {
			start = n
		}
		if body, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(body + " ")
			continue
		}
		cur.WriteString(line)
		cmd, args, _ := strings.Cut(cur.String(), " ")
		out = append(out, instruction{start, strings.ToUpper(cmd), strings.TrimSpace(args)})
		cur.Reset()
	}
	if err := sc.Err(); err != nil || cur.Len() > 0 {
		t.Fatalf("Dockerfile: %v (or a continuation at its end)", err)
	}
	return out
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// dockerStage is one FROM ... and the instructions up to the next.
type dockerStage struct {
	from, name string
	ins        []instruction
}

func dockerStages(t *testing.T, ins []instruction) []dockerStage {
	t.Helper()
	var st []dockerStage
	for _, in := range ins {
		if in.cmd == "FROM" {
			f := strings.Fields(in.args)
			s := dockerStage{from: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				s.name = f[2]
			}
			st = append(st, s)
			continue
		}
		if len(st) == 0 {
			if in.cmd != "ARG" {
				t.Fatalf("Dockerfile:%d: %s before FROM", in.line, in.cmd)
			}
			continue
		}
		st[len(st)-1].ins = append(st[len(st)-1].ins, in)
	}
	return st
}

// The image's shape: a golang builder of go.mod's Go version, a distroless
// (or scratch) final stage running as a non-root user, port 8080 exposed.
func TestDockerfileShape(t *testing.T) {
	st := dockerStages(t, readDockerfile(t))
	if len(st) < 2 {
		t.Fatalf("want a multi-stage build, got %d stages", len(st))
	}
	gomod, err := os.ReadFile(filepath.Join(repoRoot(t), "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVer := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	if goVer == nil || !strings.HasPrefix(st[0].from, "golang:"+string(goVer[1])) {
		t.Errorf("builder %q: want golang:%s (go.mod's Go)", st[0].from, goVer[1])
	}
	final := st[len(st)-1]
	if final.from != "scratch" && !strings.HasPrefix(final.from, "gcr.io/distroless/static") {
		t.Errorf("final stage from %q: want distroless/static or scratch (a static binary, no shell)", final.from)
	}
	user, expose := stageArg(final, "USER"), stageArg(final, "EXPOSE")
	if uid, _, _ := strings.Cut(user, ":"); uid == "" || uid == "0" || uid == "root" {
		t.Errorf("USER %q: want a non-root uid (65532)", user)
	}
	if expose != "8080" {
		t.Errorf("EXPOSE %q, want 8080", expose)
	}
	if !strings.Contains(stageArg(st[0], "RUN"), "--mount=type=cache,target=/go/pkg/mod") {
		t.Errorf("the builder's first RUN has no module cache mount")
	}
}

// stageArg is the arguments of the stage's first instruction cmd ("" if none).
func stageArg(s dockerStage, cmd string) string {
	for _, in := range s.ins {
		if in.cmd == cmd {
			return in.args
		}
	}
	return ""
}

// The Dockerfile's go build, run as written (CGO_ENABLED=0, -trimpath, the
// version's ldflags) on the files .dockerignore lets into the build
// context, builds a binary whose `version` reports the build arguments; its
// ENTRYPOINT is that binary and a real verb whose flags parse, serving on
// the port the image exposes.
func TestDockerfileBuilds(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvgate as the Dockerfile does (make test runs it)")
	}
	st := dockerStages(t, readDockerfile(t))
	build, final := st[0], st[len(st)-1]
	args := map[string]string{"VERSION": "v9.8.7-test", "COMMIT": "0123abcd", "DATE": "2026-11-27T00:00:00Z"}
	bin := filepath.Join(t.TempDir(), "kvgate")
	out := runDockerBuild(t, build, args, bin)
	entry := entrypoint(t, final)
	if src := copiedFrom(t, final, build.name, entry[0]); src != out {
		t.Fatalf("ENTRYPOINT runs %s, copied from %s; the build writes %s", entry[0], src, out)
	}
	var b buildInfo
	v, err := exec.Command(bin, "version", "--json").Output()
	if err := errors.Join(err, json.Unmarshal(v, &b)); err != nil {
		t.Fatalf("version: %v %s", err, v)
	}
	if b.Version != args["VERSION"] || b.Commit != args["COMMIT"] || b.Date != args["DATE"] || b.Go != runtime.Version() {
		t.Fatalf("version %+v, want the build arguments %v", b, args)
	}
	if !slices.ContainsFunc(verbs(), func(v verb) bool { return v.name == entry[1] }) {
		t.Fatalf("ENTRYPOINT %v: %q is no kvgate verb", entry, entry[1])
	}
	check := append(slices.Clone(entry[1:]), "--check-config", "--replicas", "http://127.0.0.1:9")
	summary, err := exec.Command(bin, check...).CombinedOutput()
	if err != nil || !strings.Contains(string(summary), "listen:    :"+stageArg(final, "EXPOSE")+"\n") {
		t.Fatalf("kvgate %v: %v\n%s", check, err, summary)
	}
}

// runDockerBuild runs the build stage's go build (its RUN after the mount
// options, ${ARG}s expanded from args) with -o bin, in a copy of the build
// context, and returns the -o path the Dockerfile gives.
func runDockerBuild(t *testing.T, build dockerStage, args map[string]string, bin string) string {
	t.Helper()
	var run string
	for _, in := range build.ins {
		if in.cmd == "ARG" {
			name, _, _ := strings.Cut(in.args, "=")
			if _, ok := args[name]; !ok {
				t.Fatalf("Dockerfile:%d: ARG %s: the test gives no value", in.line, name)
			}
		}
		if in.cmd == "RUN" && strings.Contains(in.args, "go build") {
			run = in.args
		}
	}
	for strings.HasPrefix(run, "--") {
		_, run, _ = strings.Cut(run, " ") // --mount=...
		run = strings.TrimSpace(run)
	}
	run = os.Expand(run, func(k string) string { return args[k] })
	words, ops, err := shellWords(run)
	if err != nil || slices.Contains(ops, true) {
		t.Fatalf("the build's RUN %q: want one command: %v", run, err)
	}
	env := os.Environ()
	for len(words) > 0 && strings.Contains(words[0], "=") {
		env, words = append(env, words[0]), words[1:]
	}
	if !slices.Contains(env, "CGO_ENABLED=0") || !slices.Contains(words, "-trimpath") || words[0] != "go" {
		t.Fatalf("the build %q: want CGO_ENABLED=0 go build -trimpath", run)
	}
	o := slices.Index(words, "-o")
	if o < 0 || o+1 >= len(words) {
		t.Fatalf("the build %q has no -o", run)
	}
	out := words[o+1]
	words[o+1] = bin
	cmd := exec.Command(goTool(), words[1:]...)
	cmd.Dir, cmd.Env = dockerContext(t), env
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", run, err, b)
	}
	return out
}

func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

// entrypoint is the final stage's ENTRYPOINT, which must be the exec form.
func entrypoint(t *testing.T, final dockerStage) []string {
	t.Helper()
	var e []string
	if err := json.Unmarshal([]byte(stageArg(final, "ENTRYPOINT")), &e); err != nil || len(e) < 2 {
		t.Fatalf("ENTRYPOINT %q: want the exec form [\"/kvgate\", \"serve\", ...]: %v", stageArg(final, "ENTRYPOINT"), err)
	}
	return e
}

// copiedFrom is the source of the final stage's COPY --from=stage to dst.
func copiedFrom(t *testing.T, final dockerStage, stage, dst string) string {
	t.Helper()
	for _, in := range final.ins {
		f := strings.Fields(in.args)
		if in.cmd == "COPY" && len(f) == 3 && f[0] == "--from="+stage && f[2] == dst {
			return f[1]
		}
	}
	t.Fatalf("no COPY --from=%s ... %s in the final stage", stage, dst)
	return ""
}

// dockerContext copies into a temporary directory the files .dockerignore
// lets into the build context, so that the build fails here if it ignores
// a file the build needs.
func dockerContext(t *testing.T) string {
	t.Helper()
	root := repoRoot(t)
	ignored := dockerignore(t, root)
	dir := t.TempDir()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		if ignored(filepath.ToSlash(rel)) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dir, rel), 0o755)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// dockerignore reads root/.dockerignore as Docker matches it: each pattern
// against the whole path from the context's root, * and ? within one path
// element, ** across any; a path under an excluded directory is excluded.
// Exceptions (!pattern) are not used, and refused.
func dockerignore(t *testing.T, root string) func(string) bool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	var res []*regexp.Regexp
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, "!") {
			t.Fatalf(".dockerignore: exception %q: this test does not model exceptions", line)
		}
		res = append(res, regexp.MustCompile("^"+globRegexp(strings.Trim(line, "/"))+"$"))
	}
	return func(rel string) bool {
		return slices.ContainsFunc(res, func(re *regexp.Regexp) bool { return re.MatchString(rel) })
	}
}

// globRegexp translates a .dockerignore pattern into a regular expression.
func globRegexp(p string) string {
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		switch {
		case strings.HasPrefix(p[i:], "**/"):
			b.WriteString("(.*/)?")
			i += 2
		case strings.HasPrefix(p[i:], "**"):
			b.WriteString(".*")
			i++
		case p[i] == '*':
			b.WriteString("[^/]*")
		case p[i] == '?':
			b.WriteString("[^/]")
		default:
			b.WriteString(regexp.QuoteMeta(string(p[i])))
		}
	}
	return b.String()
}

// The .dockerignore matcher matches as Docker does.
func TestDockerignoreMatch(t *testing.T) {
	for _, tc := range []struct {
		pattern, path string
		want          bool
	}{
		{".git", ".git", true}, {"*.test", "kvgate.test", true}, {"*.test", "cmd/kvgate.test", false},
		{"**/testdata/fuzz", "internal/fleet/testdata/fuzz", true}, {"**/testdata/fuzz", "testdata/fuzz", true},
		{"**/testdata/fuzz", "internal/fleet/testdata", false}, {"bin", "cmd/bin", false},
		{"a?b", "axb", true}, {"a?b", "a/b", false},
	} {
		re := regexp.MustCompile("^" + globRegexp(tc.pattern) + "$")
		if got := re.MatchString(tc.path); got != tc.want {
			t.Errorf("%q against %q: %v, want %v", tc.pattern, tc.path, got, tc.want)
		}
	}
}
