package main

import (
	"context"
	"flag"
	"fmt"
	"time"
)

// demoFlags are bench's flags with demoDefaults, always --embedded: the
// newcomer's first command. Simulated replicas, a gateway and a benchmark
// of five policies on a multi-turn chat workload, each policy on a fresh
// fleet, ending with the table and an HTML report.
type demoFlags struct{ benchFlags }

func (f *demoFlags) register(fs *flag.FlagSet) {
	f.embedded = true
	f.registerLoad(fs, demoDefaults)
}

func (f *demoFlags) run(ctx context.Context, inv invocation) error {
	c, err := f.config(inv, "kvgate demo")
	if err != nil {
		return err
	}
	fmt.Fprintf(inv.stdout, "kvgate demo: %s (%s, time ×%g), workload %s, policies %s\n",
		count(f.replicas, "simulated replica"), f.profile, f.timeScale, f.workload, f.policies)
	start := time.Now()
	res, err := c.run(ctx, inv.stderr)
	if err != nil {
		return err
	}
	if err := c.out.Write(inv.stdout, inv.stderr, res); err != nil {
		return err
	}
	fmt.Fprintf(inv.stdout, "Done in %s.", time.Since(start).Round(time.Second))
	if c.out.ReportDir != "" {
		fmt.Fprintf(inv.stdout, " Open %s/index.html in a browser.", c.out.ReportDir)
	}
	fmt.Fprintln(inv.stdout)
	return nil
}
