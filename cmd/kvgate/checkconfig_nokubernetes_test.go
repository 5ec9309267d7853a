//go:build nokubernetes

package main

import (
	"strings"
	"testing"
)

// Built with -tags nokubernetes: a Kubernetes discovery configuration is
// refused, by --check-config and by serve alike, with the build tag named;
// the other sources still work.
func TestNoKubernetesBuildRefusesKubernetesDiscovery(t *testing.T) {
	cfg := writeConfig(t, "discovery: {kubernetes: {namespace: llm, selector: kubernetes.io/service-name=vllm, port: http}}\n")
	const want = "this kvgate was built without Kubernetes discovery (build tag nokubernetes)"
	for _, args := range [][]string{
		{"serve", "--check-config", "--config", cfg},
		{"serve", "--config", cfg, "--listen", "127.0.0.1:0"},
	} {
		code, _, errs := runCmd(t, "", args...)
		if code == 0 || !strings.Contains(errs, want) {
			t.Errorf("%v: exit %d, stderr %q; want a refusal naming the build tag", args, code, errs)
		}
	}
	if code, out, errs := runCmd(t, "", "serve", "--check-config", "--config",
		writeConfig(t, "discovery: {dns: vllm.llm.svc.cluster.local:8000}\n")); code != 0 {
		t.Fatalf("dns discovery: exit %d: %s%s", code, out, errs)
	}
}
