//go:build !nokubernetes

package main

import (
	"path/filepath"
	"strings"
	"testing"
)

// With Kubernetes discovery linked (the default build), --check-config
// describes it without asking the API (no kubeconfig exists), and reports
// what the plugin's Validate refuses: a bad selector among them.
func TestCheckConfigKubernetes(t *testing.T) {
	t.Setenv("KUBECONFIG", filepath.Join(t.TempDir(), "none"))
	const head = "discovery: {kubernetes: {namespace: llm, port: http, "
	code, out, errs := runCmd(t, "", "serve", "--check-config", "--config",
		writeConfig(t, head+"selector: kubernetes.io/service-name=vllm}}\n"))
	if code != 0 || !strings.Contains(out, "replicas of the EndpointSlices kubernetes.io/service-name=vllm in namespace llm") ||
		!strings.Contains(out, "found while serving") {
		t.Fatalf("exit %d: %s%s", code, out, errs)
	}
	for _, tc := range []struct{ yaml, want string }{
		{head + "selector: 'a=('}}\n", "discovery.kubernetes.selector"},
		{head + "selector: app=vllm, role_label: 'a b'}}\n", "discovery.kubernetes.role_label"},
		{"pools: [{name: p, models: [m], discovery: {kubernetes: {namespace: LLM, selector: app=vllm, port: 1}}}]\n",
			"discovery.kubernetes.namespace \"LLM\""},
	} {
		code, out, errs := runCmd(t, "", "serve", "--check-config", "--config", writeConfig(t, tc.yaml))
		if code != 2 || out != "" || !strings.Contains(errs, tc.want) {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want 2 and %q", tc.yaml, code, out, errs, tc.want)
		}
	}
}
