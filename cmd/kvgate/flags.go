package main

import (
	"flag"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
)

// listFlag is the one repeatable flag of every verb: each use appends its
// value (--workload-param, --policy-param, --replica-profile). The verb's
// config parses the values.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

// paramValue types a parameter's value as the policies take it: a number,
// else a boolean, else the string.
func paramValue(v string) any {
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		return f
	}
	if b, err := strconv.ParseBool(v); err == nil {
		return b
	}
	return v
}

// parseParam splits one name=value.
func parseParam(s string) (string, any, error) {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return "", nil, fmt.Errorf("want name=value, got %q", s)
	}
	return k, paramValue(v), nil
}

// policyParams is --policy-param as bench and replay take it: name=value
// for every policy, POLICY.name=value for that one (which wins).
type policyParams struct {
	common map[string]any
	scoped map[string]map[string]any
}

// parsePolicyParams parses the flag's values for a run of policies: a
// scoped parameter must name one of them, and each policy must accept its
// parameters (checked now, with the flag named, rather than after other
// policies ran).
func parsePolicyParams(values []string, policies []string) (policyParams, error) {
	p := policyParams{common: map[string]any{}, scoped: map[string]map[string]any{}}
	for _, s := range values {
		k, v, err := parseParam(s)
		if err != nil {
			return p, fmt.Errorf("%w: --policy-param: %v", errUsage, err)
		}
		pol, name, ok := strings.Cut(k, ".")
		if !ok {
			p.common[k] = v
			continue
		}
		if !slices.Contains(policies, pol) {
			return p, fmt.Errorf("%w: --policy-param %s: policy %q is not in --policies", errUsage, k, pol)
		}
		if p.scoped[pol] == nil {
			p.scoped[pol] = map[string]any{}
		}
		p.scoped[pol][name] = v
	}
	for _, pol := range policies {
		if ps := p.of(pol); ps != nil {
			if _, err := policy.New(pol, policy.Options{Params: ps}); err != nil {
				return p, fmt.Errorf("%w: --policy-param: %v", errUsage, err)
			}
		}
	}
	return p, nil
}

// of is the parameters of one policy, nil when none apply.
func (p policyParams) of(pol string) map[string]any {
	if len(p.common)+len(p.scoped[pol]) == 0 {
		return nil
	}
	ps := maps.Clone(p.common)
	maps.Copy(ps, p.scoped[pol])
	return ps
}

// parseReplicaProfiles parses --replica-profile I=NAME values: replica →
// profile name.
func parseReplicaProfiles(values []string) (map[int]string, error) {
	m := map[int]string{}
	for _, v := range values {
		k, name, ok := strings.Cut(v, "=")
		i, err := strconv.Atoi(strings.TrimSpace(k))
		if !ok || err != nil || i < 0 || strings.TrimSpace(name) == "" {
			return nil, fmt.Errorf("%w: --replica-profile: want I=NAME with I a replica number from 0, got %q", errUsage, v)
		}
		m[i] = strings.TrimSpace(name)
	}
	return m, nil
}

// outputFlags are --json and --report, shared by bench, demo and replay.
type outputFlags struct {
	json, report string
}

func (o *outputFlags) register(fs *flag.FlagSet, reportDefault string) {
	fs.StringVar(&o.json, "json", "", "write the result as JSON to this file")
	fs.StringVar(&o.report, "report", reportDefault, "write an HTML report (with charts) into this directory")
}

// outputs is where a verb's result goes besides the table.
func (o outputFlags) outputs(title string) report.Outputs {
	return report.Outputs{JSON: o.json, ReportDir: o.report, Title: title}
}

// programFlags configure the program table of replay's routers
// (router.ProgramConfig), as serve's programs: key does.
type programFlags struct {
	ttl, wait, window time.Duration
	share             float64
	admission         bool
	burstCap          int
	minContext        int
}

func (p *programFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&p.ttl, "program-idle-ttl", router.DefaultProgramIdleTTL, "a program idle this long releases its KV reservation")
	fs.DurationVar(&p.wait, "program-admission-wait", router.DefaultProgramAdmissionWait,
		"how long a new program waits for KV room before it is placed anyway (ttft places programs)")
	fs.BoolVar(&p.admission, "program-kv-admission", true, "KV admission by program: a new program goes only where the live programs leave it room, once programs are long (--program-admission-min-context)")
	fs.IntVar(&p.minContext, "program-admission-min-context", router.DefaultAdmissionMinContext,
		"KV admission holds new programs only once the contexts of programs gone idle average this many tokens (0: whatever they are)")
	fs.Float64Var(&p.share, "program-kv-share", router.DefaultProgramKVShare, "with --program-kv-admission: share of a replica's KV the live programs homed there may reserve")
	fs.DurationVar(&p.window, "burst-window", router.DefaultBurstWindow, "identical prompts within this long of the first go to its replica (0: off)")
	fs.IntVar(&p.burstCap, "burst-cap", router.DefaultBurstCap, "requests of one burst a replica takes (0: no cap)")
}

// check rejects values that cannot run.
func (p *programFlags) check() error {
	switch {
	case p.ttl <= 0 || p.wait <= 0:
		return fmt.Errorf("%w: --program-idle-ttl %v and --program-admission-wait %v must be > 0", errUsage, p.ttl, p.wait)
	case !(p.share > 0 && p.share <= 1):
		return fmt.Errorf("%w: --program-kv-share %v: want (0, 1]", errUsage, p.share)
	case p.minContext < 0 || p.minContext > 1<<24:
		return fmt.Errorf("%w: --program-admission-min-context %d: want 0 to %d tokens", errUsage, p.minContext, 1<<24)
	case p.window < 0 || p.burstCap < 0:
		return fmt.Errorf("%w: --burst-window %v and --burst-cap %d must be ≥ 0", errUsage, p.window, p.burstCap)
	}
	return nil
}

// config is the router's ProgramConfig, as serve's programs: makes it.
func (p *programFlags) config() router.ProgramConfig {
	c := gateway.DefaultPrograms()
	c.IdleTTL, c.AdmissionWait, c.KVShare = gateway.Duration(p.ttl), gateway.Duration(p.wait), p.share
	c.KVAdmission, c.AdmissionMinContext = p.admission, p.minContext
	c.BurstWindow, c.BurstCap = gateway.Duration(p.window), p.burstCap
	return c.RouterConfig()
}
