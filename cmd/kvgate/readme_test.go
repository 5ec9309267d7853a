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

// TestREADMECommands runs the commands of README.md's code blocks, so that a
// README command that no longer works fails CI. Every line of a code block
// that starts with `kvgate VERB` is run, with kvgate built from this tree, in
// order, a block being one scenario (blocks run in parallel, each in its own
// directory); `curl ... | grep ...` is run by Go equivalents (curl and grep
// in shell_test.go); `make ...` is skipped (make test is what runs this test,
// and make demo is `kvgate demo`); any other line is taken as output.
//
// What the test changes, and nothing else:
//   - Ports: every 127.0.0.1:P, localhost:P and --*port P of a block moves by
//     one offset to free ports, so that the block's commands still agree;
//     sim's and serve's default ports are made explicit first.
//   - Size: long runs get the small bounds of readmeLimits (--requests, ...).
//   - Place: a block runs in a temporary directory beside which ../shared is
//     the repository's ../shared, as the README assumes; its outputs (--json,
//     --report) land there and are checked.
//
// `kvgate sim` and `kvgate serve` (and any line ending in &) run in the
// background: the next line starts once every URL they print answers
// (/health for sim, /ready for serve: a replica is healthy); at the end of
// the block they get SIGINT and must exit 0.
func TestREADMECommands(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvgate and runs every README command (make test runs it)")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	blocks := readmeBlocks(t, filepath.Join(root, "README.md"))
	n := 0
	for _, b := range blocks {
		n += len(b)
	}
	if n < 8 {
		t.Fatalf("README.md: only %d commands found in code blocks: is readmeBlocks broken?", n)
	}
	bin := buildKvgate(t)
	for _, b := range blocks {
		t.Run(fmt.Sprintf("README.md:%d", b[0].line), func(t *testing.T) {
			t.Parallel()
			runBlock(t, readmeEnv{bin: bin, dir: readmeWorkDir(t, root)}, b)
		})
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

// readmeEnv is where a block runs: the kvgate binary and the directory.
type readmeEnv struct {
	bin, dir string
}

// readmeCommand is one command of a code block, continuation lines joined.
type readmeCommand struct {
	line int    // README line where it starts
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
		cur                      []readmeCommand
		pending                  *readmeCommand // a command continued on the next line
		inFence, shell, inIndent bool
		prevBlank                = true
	)
	flush := func() {
		if len(cur) > 0 {
			blocks = append(blocks, cur)
		}
		cur, pending = nil, nil
	}
	for i, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		switch indented := strings.HasPrefix(line, "    ") || strings.HasPrefix(line, "\t"); {
		case strings.HasPrefix(trimmed, "```"):
			flush()
			inFence, inIndent = !inFence, false
			shell = slices.Contains([]string{"", "sh", "bash", "shell", "console"}, strings.TrimPrefix(trimmed, "```"))
		case inFence:
			if shell {
				pending = addCodeLine(&cur, pending, i+1, trimmed)
			}
		case indented && (inIndent || prevBlank):
			inIndent = true
			pending = addCodeLine(&cur, pending, i+1, trimmed)
		case trimmed != "":
			inIndent = false
			flush()
		}
		prevBlank = trimmed == ""
	}
	flush()
	return blocks
}

// addCodeLine adds one line of code to the block's commands; pending is a
// command continued on the next line (a trailing backslash).
func addCodeLine(cur *[]readmeCommand, pending *readmeCommand, lineNo int, code string) *readmeCommand {
	if pending != nil {
		pending.text += " " + code
	} else {
		code = strings.TrimPrefix(code, "$ ")
		if !isCommand(code) {
			return nil
		}
		*cur = append(*cur, readmeCommand{line: lineNo, text: code})
		pending = &(*cur)[len(*cur)-1]
	}
	if strings.HasSuffix(pending.text, `\`) {
		pending.text = strings.TrimSpace(strings.TrimSuffix(pending.text, `\`))
		return pending
	}
	pending.text = stripComment(pending.text)
	return nil
}

var verbShaped = regexp.MustCompile(`^kvgate( [a-z][a-z-]*( |$)|$)`)

// isCommand tells a command from output: kvgate followed by a verb-shaped
// word (not "kvgate demo: 4 replicas..."), curl or make.
func isCommand(code string) bool {
	return verbShaped.MatchString(code) || strings.HasPrefix(code, "curl ") || strings.HasPrefix(code, "make ")
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
// condition (a flag that must be present) holds.
var readmeLimits = map[string][]struct{ flag, bound, when string }{
	"replay": {{"requests", "8", ""}, {"kv-blocks", "8000", ""}},
	"bench": {{"requests", "8", ""}, {"time-scale", "100", "embedded"},
		{"duration", "1s", ""}, {"soak-interval", "250ms", "duration"}},
	"demo": {{"requests", "8", ""}, {"time-scale", "100", ""}},
}

// limited applies readmeLimits to a kvgate command's arguments.
func limited(args []string) []string {
	if len(args) == 0 {
		return args
	}
	for _, l := range readmeLimits[args[0]] {
		if l.when != "" && flagIndex(args, l.when) < 0 {
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

// flagIndex is the index of --name (or -name, or --name=v) in args, or −1.
func flagIndex(args []string, name string) int {
	for i, a := range args {
		if n, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "="); strings.HasPrefix(a, "-") && n == name {
			return i
		}
	}
	return -1
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
		switch {
		case strings.HasPrefix(c.text, "kvgate sim") && !strings.Contains(c.text, "-port"):
			c.text += " --port 8000"
		case strings.HasPrefix(c.text, "kvgate serve") && !strings.Contains(c.text, "-listen"):
			c.text += " --listen 127.0.0.1:8080"
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

// runBlock runs one code block's commands in order; background commands
// stop when the block ends.
func runBlock(t *testing.T, env readmeEnv, block []readmeCommand) {
	for _, c := range shiftPorts(t, block) {
		where := fmt.Sprintf("README.md:%d: %s", c.line, c.text)
		if strings.HasPrefix(c.text, "make ") {
			t.Logf("%s: skipped (make runs this test, or a kvgate command tested on its own)", where)
			continue
		}
		p, err := parsePipeline(c.text)
		if err != nil {
			t.Fatalf("%s\n  the README test cannot run this line (%v): write it as the test runs commands, or extend readme_test.go", where, err)
		}
		if p.background || slices.Contains([]string{"sim", "serve"}, verbOf(p.stages[0])) {
			env.start(t, where, limited(p.stages[0][1:]))
			continue
		}
		if err := p.run(env); err != nil {
			t.Fatalf("%s\n  %v", where, err)
		}
	}
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
// it prints answers (or it ends by itself, successfully); when the block
// ends it gets SIGINT and must exit 0.
func (env readmeEnv) start(t *testing.T, where string, args []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out, errb := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	cmd := env.command(ctx, args, out, errb)
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("%s\n  %v", where, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	ended := false
	t.Cleanup(func() {
		cancel()
		// Wait says context.Canceled for a command that exits 0 after SIGINT.
		if err := <-done; !ended && !errors.Is(err, context.Canceled) {
			t.Errorf("%s\n  stopped by SIGINT: %v; stderr:\n%s", where, err, errb.String())
		}
	})
	probe := map[string]string{"sim": "/health", "serve": "/ready"}[args[0]]
	testutil.Eventually(t, 30*time.Second, where+": ready", func() bool {
		select {
		case err := <-done:
			if err != nil {
				ended = true
				done <- err // for the cleanup, which must not wait for ever
				t.Fatalf("%s\n  ran: kvgate %s\n  %v; stderr:\n%s", where, strings.Join(args, " "), err, errb.String())
			}
			ended = true
			done <- nil // for the cleanup
			return true
		default:
		}
		return answers(out.String(), probe)
	})
	if ended {
		t.Logf("%s: ended by itself", where)
	}
}

var printedURL = regexp.MustCompile(`http://[0-9a-z.]+:\d+`)

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
