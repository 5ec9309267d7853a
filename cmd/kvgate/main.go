// Command kvgate is a cache-aware router for LLM serving: an OpenAI-compatible
// gateway, simulated vLLM replicas, a live benchmark and an offline replay.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// verb is one subcommand.
type verb struct {
	name, summary string
	run           func(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error
}

func verbs() []verb {
	return []verb{
		{"serve", "the gateway: an OpenAI-compatible reverse proxy with pluggable routing policies", runServe},
		{"sim", "N simulated vLLM-compatible replicas (API, prefix cache, metrics, KV events)", runSim},
		{"bench", "drive load through a gateway, measure TTFT/ITL/E2E/hit rate per policy", runBench},
		{"replay", "run a trace through the policies and the replica model in virtual time", runReplay},
		{"route", "the seed function: LRU-affinity assignment of prefix hashes (JSON on stdin)", runRoute},
		{"demo", "sim + serve + bench in one command, ending with a table and a report", runDemo},
	}
}

// errUsage marks a command-line mistake: exit status 2.
var errUsage = errors.New("usage")

// errNotBuilt marks a verb that does not exist yet: exit status 2.
var errNotBuilt = errors.New("not built yet")

func notBuilt(name string) func(context.Context, []string, io.Reader, io.Writer, io.Writer) error {
	return func(context.Context, []string, io.Reader, io.Writer, io.Writer) error {
		return fmt.Errorf("kvgate %s: %w", name, errNotBuilt)
	}
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "kvgate — a cache-aware router for LLM serving\n\nUsage: kvgate <command> [flags]\n\nCommands:\n")
	for _, v := range verbs() {
		fmt.Fprintf(w, "  %-7s %s\n", v.name, v.summary)
	}
	fmt.Fprintf(w, "\nRun 'kvgate <command> -h' for a command's flags.\n")
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
	}
	for _, v := range verbs() {
		if v.name != args[0] {
			continue
		}
		err := v.run(ctx, args[1:], stdin, stdout, stderr)
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.Is(err, errUsage), errors.Is(err, errNotBuilt):
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
