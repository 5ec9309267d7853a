package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// The little shell the README test understands: words with '…' and "…"
// quoting, one pipeline (a | b), and a trailing & for the background. Its
// programs: kvgate (built from this tree), curl and grep (Go equivalents).

// pipeline is one command line: its stages' words.
type pipeline struct {
	stages     [][]string
	background bool
}

// errShell is a line the README test's shell cannot run.
var errShell = errors.New("not understood")

func parsePipeline(s string) (pipeline, error) {
	words, ops, err := shellWords(s)
	if err != nil {
		return pipeline{}, err
	}
	p := pipeline{stages: [][]string{nil}}
	for i, w := range words {
		switch {
		case !ops[i]:
			last := len(p.stages) - 1
			p.stages[last] = append(p.stages[last], w)
		case w == "|":
			p.stages = append(p.stages, nil)
		case w == "&" && i == len(words)-1:
			p.background = true
		default:
			return p, fmt.Errorf("%w: operator %q", errShell, w)
		}
	}
	for k, st := range p.stages {
		switch {
		case len(st) == 0:
			return p, fmt.Errorf("%w: an empty command", errShell)
		case k == 0 && !slices.Contains([]string{"kvgate", "curl"}, st[0]):
			return p, fmt.Errorf("%w: program %q (kvgate and curl are run)", errShell, st[0])
		case k > 0 && st[0] != "grep":
			return p, fmt.Errorf("%w: %q after a pipe (grep is run)", errShell, st[0])
		case p.background && len(p.stages) > 1:
			return p, fmt.Errorf("%w: a pipeline in the background", errShell)
		}
	}
	return p, nil
}

// shellWords splits s into words and operators (| & ; < > and their
// doubles), ops[i] telling which. Variables are not expanded: a $ outside
// single quotes is an error.
func shellWords(s string) (words []string, ops []bool, err error) {
	var (
		cur    strings.Builder
		inWord bool
		quote  rune
	)
	end := func() {
		if inWord {
			words, ops = append(words, cur.String()), append(ops, false)
		}
		cur.Reset()
		inWord = false
	}
	rs := []rune(s)
	for i := 0; i < len(rs); i++ {
		c := rs[i]
		switch {
		case quote != 0 && c == quote:
			quote = 0
		case quote == '\'' || quote == '"' && c != '$':
			cur.WriteRune(c)
		case c == '$':
			return nil, nil, fmt.Errorf("%w: a variable ($)", errShell)
		case c == '\'' || c == '"':
			quote, inWord = c, true
		case c == ' ' || c == '\t':
			end()
		case strings.ContainsRune("|&;<>", c):
			end()
			op := string(c)
			if i+1 < len(rs) && rs[i+1] == c {
				op, i = op+op, i+1
			}
			words, ops = append(words, op), append(ops, true)
		default:
			cur.WriteRune(c)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, nil, fmt.Errorf("%w: an unclosed quote", errShell)
	}
	end()
	return words, ops, nil
}

// run runs the pipeline in the foreground.
func (p pipeline) run(env readmeEnv) error {
	var (
		out string
		err error
	)
	if first := p.stages[0]; first[0] == "kvgate" {
		out, err = env.kvgate(first[1:])
	} else {
		out, err = curl(first[1:])
	}
	for _, st := range p.stages[1:] {
		if err != nil {
			break
		}
		out, err = grep(out, st[1:])
	}
	return err
}

// curl is the part of curl the README uses: -s, -S, -f, -i (and clusters
// such as -sf), -H, -d (POST, as application/x-www-form-urlencoded unless
// -H gives a Content-Type, as curl does), -X, -D - (headers before the
// body), one URL.
// --retry N, --retry-delay S, --retry-all-errors and --retry-connrefused
// (a reader's wait for /ready) are accepted and make one attempt: the test
// waited for every server it started to answer before the next line.
func curl(args []string) (string, error) {
	var (
		method, url, data string
		headers           []string
		dumpHeaders, fail bool
	)
	for i := 0; i < len(args); i++ {
		a := args[i]
		takesValue := slices.Contains([]string{"-H", "--header", "-d", "--data", "--data-raw", "-X", "--request", "-D", "--dump-header", "--retry", "--retry-delay"}, a)
		if takesValue && i+1 >= len(args) {
			return "", fmt.Errorf("curl: %s needs a value", a)
		}
		switch {
		case a == "-H" || a == "--header":
			headers, i = append(headers, args[i+1]), i+1
		case a == "-d" || a == "--data" || a == "--data-raw":
			data, i = args[i+1], i+1
			method = cmp.Or(method, http.MethodPost)
		case a == "-X" || a == "--request":
			method, i = args[i+1], i+1
		case a == "-D" || a == "--dump-header":
			if args[i+1] != "-" {
				return "", fmt.Errorf("curl: %w: %s %s (only - , stdout)", errShell, a, args[i+1])
			}
			dumpHeaders, i = true, i+1
		case a == "--retry" || a == "--retry-delay":
			i++
		case a == "--retry-all-errors" || a == "--retry-connrefused":
		case shortFlags.MatchString(a):
			dumpHeaders = dumpHeaders || strings.Contains(a, "i")
			fail = fail || strings.Contains(a, "f")
		case a == "--include":
			dumpHeaders = true
		case a == "--fail":
			fail = true
		case a == "--silent" || a == "--show-error":
		case !strings.HasPrefix(a, "-") && url == "":
			url = a
		default:
			return "", fmt.Errorf("curl: %w: %s (extend curl in shell_test.go)", errShell, a)
		}
	}
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	return curlDo(cmp.Or(method, http.MethodGet), url, data, headers, dumpHeaders, fail)
}

// grepFlags is a cluster of grep's flags the test knows: -i, -q, -E.
var grepFlags = regexp.MustCompile(`^-[iqE]+$`)

// shortFlags is a cluster of curl's flags without a value: -s, -S, -f, -i.
var shortFlags = regexp.MustCompile(`^-[sSfi]+$`)

func curlDo(method, url, data string, headers []string, dumpHeaders, fail bool) (string, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(data))
	if err != nil {
		return "", fmt.Errorf("curl: %v", err)
	}
	if data != "" {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded") // curl's, for -d
	}
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ":")
		req.Header.Set(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("curl: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("curl: reading the body: %v", err)
	}
	if fail && resp.StatusCode >= 400 {
		return "", fmt.Errorf("curl: %s: %s\n%s", url, resp.Status, body)
	}
	var out strings.Builder
	if dumpHeaders {
		fmt.Fprintf(&out, "%s %s\r\n", resp.Proto, resp.Status)
		_ = resp.Header.Write(&out)
		out.WriteString("\r\n")
	}
	out.Write(body)
	return out.String(), nil
}

// grep is grep [-i] [-q] [-E] PATTERN on in (flags alone or together, as
// -iE): the matching lines, and an error (grep's exit status 1) when none
// matches. Patterns are Go's regular expressions, which read -E's syntax.
func grep(in string, args []string) (string, error) {
	var pattern string
	ci := false
	for _, a := range args {
		switch {
		case grepFlags.MatchString(a) && pattern == "":
			ci = ci || strings.Contains(a, "i")
		case strings.HasPrefix(a, "-") && pattern == "":
			return "", fmt.Errorf("grep: %w: %s (extend grep in shell_test.go)", errShell, a)
		default:
			pattern = a
		}
	}
	if ci {
		pattern = "(?i)" + pattern
	}
	re, err := regexp.Compile(pattern)
	if err != nil {
		return "", fmt.Errorf("grep: %v", err)
	}
	var out []string
	for _, line := range strings.Split(in, "\n") {
		if re.MatchString(strings.TrimRight(line, "\r")) {
			out = append(out, line)
		}
	}
	if len(out) == 0 {
		return "", fmt.Errorf("grep %s: no line matches in:\n%s", strings.Join(args, " "), in)
	}
	return strings.Join(out, "\n"), nil
}

// job is a kvgate command a block started in the background (a line
// ending in &).
type job struct {
	where  string
	cmd    *exec.Cmd
	cancel context.CancelFunc // SIGINT, then SIGKILL after the command's WaitDelay
	done   chan struct{}      // closed when it has exited, err then set
	err    error
	errb   *testutil.SyncBuffer
}

func (j *job) ended() bool {
	select {
	case <-j.done:
		return true
	default:
		return false
	}
}

// jobs are a block's background commands, in the order started (kill %N
// names the N-th, as a fresh interactive shell numbers them), and the
// names NAME=$! gave them.
type jobs struct {
	list []*job
	vars map[string]*job
	last *job
}

func (js *jobs) add(j *job) { js.list, js.last = append(js.list, j), j }

// control runs NAME=$!, kill and wait.
func (js *jobs) control(line string) error {
	words := strings.Fields(stripComment(line))
	switch {
	case strings.HasSuffix(words[0], "=$!"):
		if js.last == nil {
			return fmt.Errorf("%w: $! before any command was started with &", errShell)
		}
		js.vars[strings.TrimSuffix(words[0], "=$!")] = js.last
		return nil
	case words[0] == "kill":
		return js.kill(words[1:])
	default: // wait
		if r := js.running(); len(r) > 0 {
			return fmt.Errorf("wait would never return: %s is still running (kill it first)", r[0].where)
		}
		return nil
	}
}

// running are the jobs that have not exited.
func (js *jobs) running() []*job {
	var out []*job
	for _, j := range js.list {
		if !j.ended() {
			out = append(out, j)
		}
	}
	return out
}

// kill sends SIGTERM to each job named (%N or $NAME) and waits for it to
// exit, which it must do with status 0 (kvgate drains and stops on SIGTERM).
func (js *jobs) kill(names []string) error {
	var targets []*job
	for _, n := range names {
		var j *job
		if k, err := strconv.Atoi(strings.TrimPrefix(n, "%")); err == nil && strings.HasPrefix(n, "%") && k >= 1 && k <= len(js.list) {
			j = js.list[k-1]
		} else if strings.HasPrefix(n, "$") {
			j = js.vars[strings.TrimPrefix(n, "$")]
		}
		if j == nil {
			return fmt.Errorf("kill %s: no such job in this block (%d started with &; names: NAME=$! after one)", n, len(js.list))
		}
		targets = append(targets, j)
	}
	for _, j := range targets {
		if !j.ended() {
			if err := j.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				return fmt.Errorf("kill: %s: %v", j.where, err)
			}
		}
	}
	for _, j := range targets {
		select {
		case <-j.done:
		case <-time.After(readmeTimeout): // a generous bound: it drains in milliseconds
			return fmt.Errorf("kill: %s did not exit within %v of SIGTERM", j.where, readmeTimeout)
		}
		if j.err != nil {
			return fmt.Errorf("kill: %s exited with %v after SIGTERM; stderr:\n%s", j.where, j.err, j.errb.String())
		}
	}
	return nil
}

// stopAll stops what the block left running (it has failed, or runBlock
// reports it): SIGINT, and waits.
func (js *jobs) stopAll() {
	for _, j := range js.list {
		j.cancel()
		<-j.done
	}
}

// The document parser: fenced and indented blocks, bin/kvgate, the lines
// that start and stop servers, a here-document kept whole with its
// indentation, and output lines left out.
func TestReadmeBlocksParse(t *testing.T) {
	doc := "Text.\n\n" +
		"    bin/kvgate sim --replicas 2 --port 18000 &\n" +
		"    SIM=$!\n" +
		"    kvgate serve --replicas http://127.0.0.1:18000 \\\n" +
		"        --policy ttft &   # the gateway\n" +
		"    X-Kvgate-Replica: http://127.0.0.1:18000\n" +
		"    kill $SIM %2\n" +
		"    wait\n\n" +
		"More text.\n\n" +
		"```sh\n" +
		"cat > pools.yaml <<'EOF'\n" +
		"pools:\n" +
		"  - name: a   # kept\n" +
		"EOF\n" +
		"vllm serve x\n" +
		"curl -s localhost:8080/ready\n" +
		"```\n\n" +
		"```yaml\nlisten: x\n```\n"
	path := filepath.Join(t.TempDir(), "doc.md")
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	want := [][]readmeCommand{
		{
			{3, "kvgate sim --replicas 2 --port 18000 &"},
			{4, "SIM=$!"},
			{5, "kvgate serve --replicas http://127.0.0.1:18000 --policy ttft &"},
			{8, "kill $SIM %2"},
			{9, "wait"},
		},
		{
			{14, "cat > pools.yaml <<'EOF'\npools:\n  - name: a   # kept"},
			{19, "curl -s localhost:8080/ready"},
		},
	}
	if got := readmeBlocks(t, path); !reflect.DeepEqual(got, want) {
		t.Errorf("blocks:\n got %+v\nwant %+v", got, want)
	}
}

// What a block does with the servers it starts: $! and kill name them, a
// server that does not exit 0 on SIGTERM fails, wait refuses to wait for
// one still running, and a foreground sim is refused before it starts.
func TestBlockJobControl(t *testing.T) {
	js := &jobs{vars: map[string]*job{}}
	for _, line := range []string{"SIM=$!", "kill %1", "kill $GW"} {
		if err := js.control(line); err == nil {
			t.Errorf("%s with no job started: no error", line)
		}
	}
	// A stand-in for a server: sleep, which SIGTERM ends with no exit 0.
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Skipf("no sleep to stand in for a server: %v", err)
	}
	j := &job{where: "sleep", cmd: cmd, cancel: func() { _ = cmd.Process.Kill() }, done: make(chan struct{}), errb: &testutil.SyncBuffer{}}
	go func() { j.err = cmd.Wait(); close(j.done) }()
	js.add(j)
	t.Cleanup(js.stopAll)
	if err := js.control("GW=$!"); err != nil {
		t.Fatal(err)
	}
	if err := js.control("wait"); err == nil || len(js.running()) != 1 {
		t.Errorf("wait with a job running: %v, %d running; want an error and 1", err, len(js.running()))
	}
	if err := js.control("kill $GW"); err == nil || !strings.Contains(err.Error(), "after SIGTERM") {
		t.Errorf("kill of a job that does not exit 0: %v; want its exit status reported", err)
	}
	if err := js.control("wait"); err != nil || len(js.running()) != 0 {
		t.Errorf("wait after kill: %v, %d running; want nil and 0", err, len(js.running()))
	}
	env := readmeEnv{bin: "/nonexistent", dir: t.TempDir(), file: "doc.md"}
	if err := runLine(t, env, js, "doc.md:1", "kvgate sim --replicas 2"); err == nil || !strings.Contains(err.Error(), "end it with &") {
		t.Errorf("a foreground sim: %v; want it refused", err)
	}
	if err := runLine(t, env, js, "doc.md:2", "cat > ../x.yaml <<'EOF'\na: 1"); err == nil {
		t.Error("cat writing outside the block's directory: no error")
	}
	if err := runLine(t, env, js, "doc.md:3", "cat > c.yaml <<'EOF'\nlisten: 127.0.0.1:1"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(env.dir, "c.yaml")); err != nil || string(b) != "listen: 127.0.0.1:1\n" {
		t.Errorf("cat wrote %q, %v", b, err)
	}
}
