package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/testutil"
)

// TestREADMECommands runs the commands of the code blocks of README.md and
// of every docs/*.md, so that a documented command that no longer works
// fails CI. Every line of a code block that starts with `kvgate VERB` (or
// `bin/kvgate VERB`) is run, with kvgate built from this tree, in order, a
// block being one scenario (blocks run in parallel, each in its own
// directory); `curl ... | grep ...` is run by Go equivalents (curl and grep
// in shell_test.go); `make ...` is skipped (make test is what runs this test,
// and make demo is `kvgate demo`); any other line is taken as output.
//
// Servers are started and stopped as a reader pasting the block would:
//   - `kvgate sim ... &` and `kvgate serve ... &` run in the background; the
//     next line starts once every URL they print answers (/health for sim,
//     /ready for serve); a reader's wait for the same (curl --retry ...
//     /ready) makes one attempt.
//   - `NAME=$!` names the last one started; `kill $NAME ...` and `kill %N`
//     (the N-th started) send SIGTERM, and each must then exit 0; `wait`
//     checks that none is still running (it would wait for ever).
//   - A block must stop what it started: a server still running at the
//     block's end fails it. `kvgate sim` without & fails (the lines after
//     it would never run); `kvgate serve` without & is the command a reader
//     runs against their own replicas, which the test cannot reach: it is
//     checked with --check-config.
//   - `cat > FILE <<'EOF'` ... `EOF` writes FILE in the block's directory
//     (a configuration the next commands read).
//
// What the test changes, and nothing else:
//   - Ports: every 127.0.0.1:P, localhost:P and --*port P of a block (files
//     written by cat included) moves by one offset to free ports, so that
//     the block's commands still agree; sim's and serve's default ports are
//     made explicit first.
//   - Size: long runs get the small bounds of readmeLimits (--requests, ...).
//   - Place: a block runs in a temporary directory beside which ../shared is
//     the repository's ../shared, as the documents assume; its outputs
//     (--json, --report) land there and are checked.
func TestREADMECommands(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvgate and runs every README and docs/ command (make test runs it)")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := append([]string{filepath.Join(root, "README.md")}, docs...)
	type fileBlocks struct {
		name   string
		blocks [][]readmeCommand
	}
	var all []fileBlocks
	n := 0
	for _, f := range files {
		name, _ := filepath.Rel(root, f)
		bs := readmeBlocks(t, f)
		for _, b := range bs {
			n += len(b)
		}
		all = append(all, fileBlocks{name, bs})
	}
	if n < 8 {
		t.Fatalf("README.md and docs/: only %d commands found in code blocks: is readmeBlocks broken?", n)
	}
	bin := buildKvgate(t)
	for _, f := range all {
		for _, b := range f.blocks {
			t.Run(fmt.Sprintf("%s:%d", f.name, b[0].line), func(t *testing.T) {
				t.Parallel()
				runBlock(t, readmeEnv{bin: bin, dir: readmeWorkDir(t, root), file: f.name}, b)
			})
		}
	}
}

// buildKvgate builds this package's command (without the race detector:
// the commands run as a user runs them, and fast).
func buildKvgate(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	bin := filepath.Join(t.TempDir(), "kvgate")
	out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// readmeEnv is where a block runs: the kvgate binary, the directory, and
// the document the block comes from (for messages).
type readmeEnv struct {
	bin, dir, file string
}

// readmeCommand is one command of a code block, continuation lines joined
// (a here-document's lines after a newline each).
type readmeCommand struct {
	line int    // the document's line where it starts
	text string // as written (without its comment)
}

// readmeBlocks returns the commands of each code block that has any:
// indented blocks, and fenced blocks without a language or marked as shell.
func readmeBlocks(t *testing.T, path string) [][]readmeCommand {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var (
		blocks                   [][]readmeCommand
		c                        collector
		inFence, shell, inIndent bool
		prevBlank                = true
	)
	flush := func() {
		if len(c.cmds) > 0 {
			blocks = append(blocks, c.cmds)
		}
		c = collector{}
	}
	for i, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		switch indented := strings.HasPrefix(line, "    ") || strings.HasPrefix(line, "\t"); {
		case inFence && c.heredoc != "":
			c.add(i+1, strings.TrimRight(line, " \t\r"))
		case strings.HasPrefix(trimmed, "```"):
			flush()
			inFence, inIndent = !inFence, false
			shell = slices.Contains([]string{"", "sh", "bash", "shell", "console"}, strings.TrimPrefix(trimmed, "```"))
		case inFence:
			if shell {
				c.add(i+1, strings.TrimRight(line, " \t\r"))
			}
		case indented && (inIndent || prevBlank), inIndent && c.heredoc != "":
			inIndent = true
			c.add(i+1, strings.TrimPrefix(strings.TrimPrefix(strings.TrimRight(line, " \t\r"), "\t"), "    "))
		case trimmed != "":
			inIndent = false
			flush()
		}
		prevBlank = trimmed == ""
	}
	flush()
	return blocks
}

// collector gathers one block's commands: a command continued on the next
// line (a trailing backslash) and a here-document's body are pending.
type collector struct {
	cmds    []readmeCommand
	pending *readmeCommand
	heredoc string // the terminator of the here-document being read
}

var heredocStart = regexp.MustCompile(`^cat > ([\w./-]+) <<'?(\w+)'?$`)

// add adds one line of code (its indentation within the block kept, for
// a here-document's sake).
func (c *collector) add(lineNo int, raw string) {
	code := strings.TrimSpace(raw)
	switch {
	case c.heredoc != "":
		if code == c.heredoc {
			c.pending, c.heredoc = nil, ""
		} else {
			c.pending.text += "\n" + raw
		}
		return
	case c.pending != nil:
		c.pending.text += " " + code
	default:
		code = strings.TrimPrefix(code, "$ ")
		if strings.HasPrefix(code, "bin/kvgate") {
			code = strings.TrimPrefix(code, "bin/")
		}
		if !isCommand(code) {
			return
		}
		c.cmds = append(c.cmds, readmeCommand{line: lineNo, text: code})
		c.pending = &c.cmds[len(c.cmds)-1]
		if m := heredocStart.FindStringSubmatch(code); m != nil {
			c.heredoc = m[2]
			return
		}
	}
	if strings.HasSuffix(c.pending.text, `\`) {
		c.pending.text = strings.TrimSpace(strings.TrimSuffix(c.pending.text, `\`))
		return
	}
	c.pending.text = stripComment(c.pending.text)
	c.pending = nil
}

var (
	verbShaped = regexp.MustCompile(`^kvgate( [a-z][a-z-]*( |$)|$)`)
	jobShaped  = regexp.MustCompile(`^([A-Z][A-Z0-9_]*=\$!|kill( +[%$]\S+)+|wait)( *#.*)?$`)
)

// isCommand tells a command from output: kvgate followed by a verb-shaped
// word (not "kvgate demo: 4 replicas..."), curl, make, the lines that start
// and stop background servers, or a here-document written by cat.
func isCommand(code string) bool {
	return verbShaped.MatchString(code) || jobShaped.MatchString(code) || heredocStart.MatchString(code) ||
		strings.HasPrefix(code, "curl ") || strings.HasPrefix(code, "make ")
}

// stripComment drops a trailing shell comment (a # after a space, outside quotes).
func stripComment(s string) string {
	var quote rune
	for i, c := range s {
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"':
			quote = c
		case c == '#' && i > 0 && s[i-1] == ' ':
			return strings.TrimSpace(s[:i])
		}
	}
	return s
}

// readmeWorkDir is an empty directory beside which ../shared is the
// repository's ../shared (the traces the README replays).
func readmeWorkDir(t *testing.T, root string) string {
	base := t.TempDir()
	work := filepath.Join(base, "main")
	if err := os.Mkdir(work, 0o755); err != nil {
		t.Fatal(err)
	}
	if shared := filepath.Join(root, "..", "shared"); dirExists(shared) {
		if err := os.Symlink(shared, filepath.Join(base, "shared")); err != nil {
			t.Fatal(err)
		}
	}
	return work
}

func dirExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// readmeLimits bound the README's long runs: per verb, flags whose value is
// set to the bound when absent or larger. A bound applies only when its
// condition (a flag that must be present) holds, and not when its
// exception (flag=value) does.
var readmeLimits = map[string][]struct{ flag, bound, when, unless string }{
	// --question cache-pressure sweeps --kv-blocks itself.
	"replay": {{"requests", "8", "", ""}, {"kv-blocks", "8000", "", "question=cache-pressure"}},
	"bench": {{"requests", "8", "", ""}, {"time-scale", "100", "embedded", ""},
		{"duration", "1s", "", ""}, {"soak-interval", "250ms", "duration", ""}},
	"demo": {{"requests", "8", "", ""}, {"time-scale", "100", "", ""}},
}

// limited applies readmeLimits to a kvgate command's arguments.
func limited(args []string) []string {
	if len(args) == 0 {
		return args
	}
	tenants := args[0] == "bench" && flagIndex(args, "tenant") >= 0
	if tenants {
		args = limitTenants(args, 8)
	}
	for _, l := range readmeLimits[args[0]] {
		if l.when != "" && flagIndex(args, l.when) < 0 {
			continue
		}
		if tenants && l.flag == "requests" {
			continue // bench refuses --requests beside --tenant: each spec was bounded
		}
		if name, value, ok := strings.Cut(l.unless, "="); ok && flagValue(args, name) == value {
			continue
		}
		i := flagIndex(args, l.flag)
		if i < 0 {
			if l.flag == "duration" || l.flag == "soak-interval" {
				continue // only shortened, never added
			}
			args = append(args, "--"+l.flag, l.bound)
			continue
		}
		name, value, inline := strings.Cut(args[i], "=")
		if !inline && i+1 < len(args) {
			value = args[i+1]
		}
		if larger(value, l.bound) {
			if inline {
				args[i] = name + "=" + l.bound
			} else if i+1 < len(args) {
				args[i+1] = l.bound
			}
		}
	}
	return args
}

// limitTenants bounds the requests=N of every --tenant spec of a bench
// command to n (bench's workload is then the tenants').
func limitTenants(args []string, n int) []string {
	out := slices.Clone(args)
	for i := 0; i < len(out); i++ {
		name, value, inline := strings.Cut(strings.TrimLeft(out[i], "-"), "=")
		if !strings.HasPrefix(out[i], "-") || name != "tenant" {
			continue
		}
		if !inline {
			if i++; i >= len(out) {
				break
			}
			value = out[i]
		}
		fields := strings.Split(value, ",")
		for j, f := range fields {
			if k, v, ok := strings.Cut(f, "="); ok && k == "requests" && larger(v, strconv.Itoa(n)) {
				fields[j] = "requests=" + strconv.Itoa(n)
			}
		}
		if inline {
			out[i] = "--tenant=" + strings.Join(fields, ",")
		} else {
			out[i] = strings.Join(fields, ",")
		}
	}
	return out
}

// flagIndex is the index of --name (or -name, or --name=v) in args, or −1.
func flagIndex(args []string, name string) int {
	for i, a := range args {
		if n, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "="); strings.HasPrefix(a, "-") && n == name {
			return i
		}
	}
	return -1
}

// flagValue is the value of --name in args ("" when absent).
func flagValue(args []string, name string) string {
	i := flagIndex(args, name)
	if i < 0 {
		return ""
	}
	if _, v, inline := strings.Cut(args[i], "="); inline {
		return v
	}
	if i+1 < len(args) {
		return args[i+1]
	}
	return ""
}

// larger compares two numbers or two durations.
func larger(v, bound string) bool {
	if a, err := strconv.ParseFloat(v, 64); err == nil {
		b, _ := strconv.ParseFloat(bound, 64)
		return a > b
	}
	a, errA := time.ParseDuration(v)
	b, errB := time.ParseDuration(bound)
	return errA == nil && errB == nil && a > b
}

// Ports as a block writes them: host:port, and the value of a --*port flag.
var (
	hostPort = regexp.MustCompile(`\b(127\.0\.0\.1|localhost):(\d{2,5})\b`)
	portFlag = regexp.MustCompile(`(--?[a-z-]*port[ =])(\d{2,5})\b`)
)

// shiftPorts makes sim's and serve's default ports explicit and moves every
// port of the block by one offset to a range that is free now.
func shiftPorts(t *testing.T, cmds []readmeCommand) []readmeCommand {
	t.Helper()
	out := make([]readmeCommand, len(cmds))
	var ports []int
	for i, c := range cmds {
		cmd, bg := strings.CutSuffix(c.text, " &")
		switch {
		case strings.HasPrefix(cmd, "kvgate sim") && !strings.Contains(cmd, "-port"):
			cmd += " --port 8000"
		case strings.HasPrefix(cmd, "kvgate serve") && !strings.Contains(cmd, "-listen"):
			cmd += " --listen 127.0.0.1:8080"
		}
		if c.text = cmd; bg {
			c.text += " &"
		}
		for _, m := range append(hostPort.FindAllStringSubmatch(c.text, -1), portFlag.FindAllStringSubmatch(c.text, -1)...) {
			if p, _ := strconv.Atoi(m[2]); p > 0 {
				ports = append(ports, p)
			}
		}
		out[i] = c
	}
	if len(ports) == 0 {
		return out
	}
	off := freeOffset(t, ports)
	shift := func(re *regexp.Regexp) func(string) string {
		return func(s string) string {
			m := re.FindStringSubmatch(s)
			p, _ := strconv.Atoi(m[2])
			if p == 0 {
				return s
			}
			return strings.TrimSuffix(s, m[2]) + strconv.Itoa(p+off)
		}
	}
	for i := range out {
		out[i].text = hostPort.ReplaceAllStringFunc(out[i].text, shift(hostPort))
		out[i].text = portFlag.ReplaceAllStringFunc(out[i].text, shift(portFlag))
	}
	return out
}

// reserved are the port ranges given to blocks so far: parallel blocks
// must not pick the same free ports.
var reserved struct {
	sync.Mutex
	ranges [][2]int
}

// freeOffset finds an offset that puts every port, and the 15 after each
// (a sim's further replicas), on a loopback port that is free now and given
// to no other block, below Linux's ephemeral range. Only those runs of 16
// are reserved, not the span between a block's lowest and highest port (a
// block with ports 5557 and 8080 would take 2,500 ports, and a dozen such
// blocks the whole range).
func freeOffset(t *testing.T, ports []int) int {
	t.Helper()
	lo, hi := slices.Min(ports), slices.Max(ports)+16
	reserved.Lock()
	defer reserved.Unlock()
	for range 1000 {
		off := 10000 + rand.IntN(22000-(hi-lo)) - lo
		taken := slices.ContainsFunc(ports, func(p int) bool {
			return slices.ContainsFunc(reserved.ranges, func(r [2]int) bool { return p+off <= r[1] && r[0] <= p+off+15 })
		})
		if !taken && allFree(ports, off) {
			for _, p := range ports {
				reserved.ranges = append(reserved.ranges, [2]int{p + off, p + off + 15})
			}
			return off
		}
	}
	t.Fatal("no free port range for the block")
	return 0
}

// allFree reports whether every port p+off+i (i < 16) can be bound now.
func allFree(ports []int, off int) bool {
	want := map[int]bool{}
	for _, p := range ports {
		for i := range 16 {
			want[p+off+i] = true
		}
	}
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	for p := range want {
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			return false
		}
		held = append(held, l)
	}
	return true
}

// runBlock runs one code block's commands in order. What it starts in the
// background the block must stop itself (jobs, in shell_test.go); what is
// still running when the block ends, or when it fails, gets SIGINT.
func runBlock(t *testing.T, env readmeEnv, block []readmeCommand) {
	js := &jobs{vars: map[string]*job{}}
	t.Cleanup(js.stopAll)
	for _, c := range shiftPorts(t, block) {
		where := fmt.Sprintf("%s:%d: %s", env.file, c.line, firstLine(c.text))
		if err := runLine(t, env, js, where, c.text); err != nil {
			t.Fatalf("%s\n  %v", where, err)
		}
	}
	for _, j := range js.running() {
		t.Errorf("%s\n  still running when the block ends: stop it in the block (NAME=$! after it, then kill $NAME)", j.where)
	}
}

// runLine runs one command of a block.
func runLine(t *testing.T, env readmeEnv, js *jobs, where, text string) error {
	switch {
	case strings.HasPrefix(text, "make "):
		t.Logf("%s: skipped (make runs this test, or a kvgate command tested on its own)", where)
		return nil
	case heredocStart.MatchString(firstLine(text)):
		return writeHeredoc(env.dir, text)
	case jobShaped.MatchString(text):
		return js.control(text)
	}
	p, err := parsePipeline(text)
	if err != nil {
		return fmt.Errorf("the README test cannot run this line (%v): write it as the test runs commands, or extend readme_test.go", err)
	}
	switch verb := verbOf(p.stages[0]); {
	case p.background:
		js.add(env.start(t, where, limited(p.stages[0][1:])))
		return nil
	case verb == "sim":
		return errors.New("kvgate sim runs until it is stopped, so the lines after it would never run: end it with &, and stop it at the end of the block")
	case (verb == "serve" || verb == "epp") && len(p.stages) == 1 && flagIndex(p.stages[0], "check-config") < 0:
		// A server a reader runs in the foreground, against replicas of
		// their own: what can be checked here is its configuration.
		p.stages[0] = append(p.stages[0], "--check-config")
	}
	return p.run(env)
}

// firstLine is a command's first line (a here-document's cat line).
func firstLine(s string) string {
	first, _, _ := strings.Cut(s, "\n")
	return first
}

// writeHeredoc writes `cat > FILE <<'EOF'`'s lines into dir/FILE.
func writeHeredoc(dir, text string) error {
	first, body, _ := strings.Cut(text, "\n")
	name := heredocStart.FindStringSubmatch(first)[1]
	if filepath.IsAbs(name) || strings.Contains(name, "..") {
		return fmt.Errorf("cat: %s: write files in the block's own directory", name)
	}
	return os.WriteFile(filepath.Join(dir, name), []byte(body+"\n"), 0o600)
}

func verbOf(stage []string) string {
	if len(stage) > 1 && stage[0] == "kvgate" {
		return stage[1]
	}
	return ""
}

// readmeTimeout bounds one command.
const readmeTimeout = 2 * time.Minute

// command is kvgate args in the block's directory; SIGINT ends it when ctx
// ends, SIGKILL 10 s later.
func (env readmeEnv) command(ctx context.Context, args []string, stdout, stderr io.Writer) *exec.Cmd {
	cmd := exec.CommandContext(ctx, env.bin, args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = env.dir, stdout, stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	return cmd
}

// kvgate runs one kvgate command to its end and checks what it wrote.
func (env readmeEnv) kvgate(args []string) (string, error) {
	args = limited(args)
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), readmeTimeout)
	defer cancel()
	if err := env.command(ctx, args, &out, &errb).Run(); err != nil {
		return "", fmt.Errorf("ran: kvgate %s\n  %v; stderr:\n%s", strings.Join(args, " "), err, errb.String())
	}
	if err := checkOutputs(env.dir, args); err != nil {
		return "", fmt.Errorf("ran: kvgate %s\n  %v", strings.Join(args, " "), err)
	}
	return out.String(), nil
}

// checkOutputs checks that --json and --report wrote their files, and that
// no request of a --json result failed: an example whose requests fail is
// broken even when the command exits 0.
func checkOutputs(dir string, args []string) error {
	for flagName, file := range map[string]string{"json": "", "report": "index.html"} {
		i := flagIndex(args, flagName)
		if i < 0 {
			continue
		}
		_, path, inline := strings.Cut(args[i], "=")
		if !inline && i+1 < len(args) {
			path = args[i+1]
		}
		b, err := os.ReadFile(filepath.Join(dir, path, file))
		if err != nil {
			return fmt.Errorf("--%s: %v", flagName, err)
		}
		if flagName != "json" {
			continue
		}
		res, err := report.ReadJSON(bytes.NewReader(b))
		if err != nil {
			return fmt.Errorf("--json: %v", err)
		}
		for _, r := range res.Runs {
			if r.Errors > 0 {
				return fmt.Errorf("--json: run %s: %d of %d requests failed", r.Policy, r.Errors, r.Requests)
			}
		}
	}
	return nil
}

// start starts a kvgate command in the background and waits until every URL
// it prints answers (or it ends by itself, successfully).
func (env readmeEnv) start(t *testing.T, where string, args []string) *job {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	j := &job{where: where, cancel: cancel, done: make(chan struct{}), errb: &testutil.SyncBuffer{}}
	out := &testutil.SyncBuffer{}
	j.cmd = env.command(ctx, args, out, j.errb)
	if err := j.cmd.Start(); err != nil {
		cancel()
		t.Fatalf("%s\n  %v", where, err)
	}
	go func() { j.err = j.cmd.Wait(); close(j.done) }()
	probe := map[string]string{"sim": "/health", "serve": "/ready", "epp": "/ready"}[args[0]]
	testutil.Eventually(t, 30*time.Second, where+": ready", func() bool {
		if j.ended() {
			return true
		}
		if args[0] == "epp" { // its ops URL answers /ready; its stand-in's is an API
			m := eppOps.FindStringSubmatch(out.String())
			return m != nil && answers(m[1], probe)
		}
		return answers(out.String(), probe)
	})
	if j.ended() {
		if j.err != nil {
			t.Fatalf("%s\n  ran: kvgate %s\n  %v; stderr:\n%s", where, strings.Join(args, " "), j.err, j.errb.String())
		}
		t.Logf("%s: ended by itself", where)
	}
	return j
}

var printedURL = regexp.MustCompile(`http://[0-9a-z.]+:\d+`)

// eppOps is the ops URL kvgate epp prints ("ops http://...").
var eppOps = regexp.MustCompile(`ops (http://[0-9a-z.]+:\d+)`)

// answers reports whether output names a URL and every URL it names
// answers 200 at path.
func answers(output, path string) bool {
	urls := printedURL.FindAllString(output, -1)
	if len(urls) == 0 || path == "" {
		return false
	}
	for _, u := range urls {
		resp, err := http.Get(u + path)
		if err != nil {
			return false
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false
		}
	}
	return true
}
