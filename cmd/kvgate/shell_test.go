package main

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
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

// curl is the part of curl the README uses: -s, -S, -f, -i, -H, -d (POST),
// -X, -D - (headers before the body), one URL.
func curl(args []string) (string, error) {
	var (
		method, url, data string
		headers           []string
		dumpHeaders, fail bool
	)
	for i := 0; i < len(args); i++ {
		a := args[i]
		takesValue := slices.Contains([]string{"-H", "--header", "-d", "--data", "--data-raw", "-X", "--request", "-D", "--dump-header"}, a)
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
		case a == "-i" || a == "--include":
			dumpHeaders = true
		case a == "-f" || a == "--fail":
			fail = true
		case a == "-s" || a == "-S" || a == "-sS" || a == "--silent" || a == "--show-error":
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

func curlDo(method, url, data string, headers []string, dumpHeaders, fail bool) (string, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(data))
	if err != nil {
		return "", fmt.Errorf("curl: %v", err)
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

// grep is grep [-i] [-q] [-E] PATTERN on in: the matching lines, and an
// error (grep's exit status 1) when none matches.
func grep(in string, args []string) (string, error) {
	var pattern string
	ci := false
	for _, a := range args {
		switch {
		case a == "-i":
			ci = true
		case a == "-q" || a == "-E":
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
