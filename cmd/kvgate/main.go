// Command kvgate is a cache-aware router for LLM serving: an OpenAI-compatible
// gateway, simulated vLLM replicas, a live benchmark and an offline replay.
//
// This package parses flags and runs verbs, nothing more: each verb has a
// flags struct whose register adds its flags to a FlagSet, whose config
// validates them and builds the configuration of the package that does the
// work, and whose run runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
)

// command is a verb's flags struct.
type command interface {
	// register adds the verb's flags to fs, their values bound to the struct.
	register(fs *flag.FlagSet)
	// run validates the parsed flags (the verb's config) and runs the verb.
	run(ctx context.Context, inv invocation) error
}

// invocation is one command line being run.
type invocation struct {
	verb   string
	args   []string        // the verb's arguments, as given
	set    map[string]bool // the flags given explicitly
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
}

// commandLine is the command line for a result's meta, without the flags
// named in drop and their values.
func (inv invocation) commandLine(drop ...string) string {
	out := []string{"kvgate", inv.verb}
	for i := 0; i < len(inv.args); i++ {
		a := inv.args[i]
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && slices.Contains(drop, name) {
			if !hasValue {
				i++ // the value is the next argument
			}
			continue
		}
		out = append(out, a)
	}
	return strings.Join(out, " ")
}

// verb is one subcommand.
type verb struct {
	name, synopsis, summary string
	flags                   func() command // a fresh flags struct for each run
}

func verbs() []verb {
	return []verb{
		{"serve", "--replicas URL,URL,... [--policy NAME] | --config FILE",
			"the gateway: an OpenAI-compatible reverse proxy with pluggable routing policies",
			func() command { return &serveFlags{} }},
		{"epp", "--replicas URL,URL,... | --config FILE [--epp-listen ADDR] [serve's flags]",
			"the endpoint picker of a Gateway API inference gateway (Envoy ext_proc), routing as serve does",
			func() command { return &eppFlags{} }},
		{"sim", "--replicas N --port P [flags]",
			"N simulated vLLM-compatible replicas (API, prefix cache, metrics, KV events)",
			func() command { return &simFlags{} }},
		{"bench", "(--target URL | --embedded [--replicas N]) [--workload NAME] [--policies a,b,...]",
			"drive load through a gateway, measure TTFT/ITL/E2E/hit rate per policy",
			func() command { return &benchFlags{} }},
		{"replay", "(--trace FILE | --workload NAME | --question Q) [flags]",
			"run a trace through the policies and the replica model in virtual time",
			func() command { return &replayFlags{} }},
		{"route", "< input.json",
			"the seed function: LRU-affinity assignment of prefix hashes (JSON on stdin)",
			func() command { return &routeFlags{} }},
		{"demo", "[--report DIR] [--replicas N] [--time-scale X] [bench flags]",
			"sim + serve + bench in one command, ending with a table and a report",
			func() command { return &demoFlags{} }},
		{"version", "[--json]",
			"print the version, commit, commit date and Go version of this binary",
			func() command { return &versionFlags{} }},
	}
}

// errUsage marks a command-line mistake: exit status 2.
var errUsage = errors.New("usage")

func usage(w io.Writer) {
	fmt.Fprintf(w, "kvgate — a cache-aware router for LLM serving\n\nUsage: kvgate <command> [flags]\n\nCommands:\n")
	for _, v := range verbs() {
		fmt.Fprintf(w, "  %-7s %s\n", v.name, v.summary)
	}
	fmt.Fprintf(w, "\nRun 'kvgate <command> -h' for a command's flags; 'kvgate --version' is 'kvgate version'.\n")
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run executes one command line and returns the exit status.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		usage(stdout)
		return 0
	case "-version", "--version":
		args = append([]string{"version"}, args[1:]...) // the verb's flags (--json) still apply
	}
	for _, v := range verbs() {
		if v.name != args[0] {
			continue
		}
		err := v.exec(ctx, invocation{verb: v.name, args: args[1:], stdin: stdin, stdout: stdout, stderr: stderr})
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.Is(err, errBadConfig):
			fmt.Fprintln(stderr, "kvgate "+v.name+":", err)
			return 2
		case errors.Is(err, errUsage):
			fmt.Fprintln(stderr, err)
			return 2
		default:
			fmt.Fprintln(stderr, "kvgate "+v.name+":", err)
			return 1
		}
	}
	fmt.Fprintf(stderr, "kvgate: unknown command %q\n\n", args[0])
	usage(stderr)
	return 2
}

// exec parses the verb's flags and runs it.
func (v verb) exec(ctx context.Context, inv invocation) error {
	fs := newFlags(v.name, v.synopsis, inv.stderr)
	c := v.flags()
	c.register(fs)
	if err := parseFlags(fs, inv.args); err != nil {
		return err
	}
	inv.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { inv.set[f.Name] = true })
	return c.run(ctx, inv)
}

// newFlags is a FlagSet that reports errors instead of exiting.
func newFlags(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("kvgate "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: kvgate %s %s\n\nFlags:\n", name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// count is n and noun, plural unless n is 1: "1 replica", "3 replicas".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// parseFlags parses and rejects stray arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: %s: unexpected argument %q", errUsage, fs.Name(), fs.Arg(0))
	}
	return nil
}
