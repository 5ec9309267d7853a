package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/sim"
)

// runDemo is the newcomer's first command: simulated replicas, a gateway and
// a benchmark of five policies on a multi-turn chat workload, each policy on
// a fresh fleet, ending with the table and an HTML report.
func runDemo(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) error {
	o := benchOptions{embedded: true, model: sim.DefaultModel, profile: costmodel.Default, kvBlocks: 30000,
		timeout: 10 * time.Minute, maxDuration: 5 * time.Minute, concurrency: 16}
	fs := newFlags("demo", "[--report DIR] [--replicas N] [--time-scale X]", stderr)
	fs.IntVar(&o.replicas, "replicas", 4, "simulated replicas")
	fs.StringVar(&o.workload, "workload", "multiturn", "workload (see kvgate bench -h)")
	fs.StringVar(&o.policies, "policies", "round_robin,least_load,prefix_key,sglang,ttft", "policies to compare")
	fs.Float64Var(&o.timeScale, "time-scale", 5, "the simulated replicas run this many times faster than real time")
	fs.Float64Var(&o.rate, "rate", 6, "Poisson arrivals of new conversations' turns, requests/s of model time")
	fs.IntVar(&o.requests, "requests", 0, "requests per policy (0: the workload's default)")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the workload, the replicas and the policies")
	fs.StringVar(&o.reportDir, "report", "kvgate-demo-report", "directory of the HTML report")
	fs.StringVar(&o.jsonPath, "json", "", "also write the results as JSON to this file")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "kvgate demo: %d simulated replicas (%s, time ×%g), workload %s, policies %s\n",
		o.replicas, o.profile, o.timeScale, o.workload, o.policies)
	start := time.Now()
	res, err := o.run(ctx, stderr)
	if err != nil {
		return err
	}
	if err := o.output(res, stdout, "kvgate demo"); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "Done in %s. Open %s/index.html in a browser.\n", time.Since(start).Round(time.Second), o.reportDir)
	return nil
}
