//go:build !nokubernetes

package main

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/gateway"
)

// --pool-name (the reference picker's flag) makes the InferencePool the
// replicas' source, over the file's: its namespace from --pool-namespace,
// else the file's discovery.kubernetes.namespace, else $NAMESPACE, else
// default; the file's kubeconfig and role label stay, its selector and
// port go. --pool-namespace alone is a usage error; a bad name is the
// configuration's error, naming the key.
func TestEPPPoolFlags(t *testing.T) {
	kube := writeConfig(t, "discovery: {scheme: https, kubernetes: {namespace: llm, selector: app=vllm, port: 8000, "+
		"role_label: tier, kubeconfig: /kc}}\n")
	static := writeConfig(t, "replicas: [{url: http://10.0.0.1:8000}]\n")
	for _, tc := range []struct {
		name, env string
		args      []string
		want      gateway.KubernetesConfig
	}{
		{"flags", "team", []string{"--pool-name", "vllm-pool", "--pool-namespace", "llm", "--pool-group", "inference.networking.x-k8s.io"},
			gateway.KubernetesConfig{Namespace: "llm", InferencePool: "vllm-pool", InferencePoolGroup: "inference.networking.x-k8s.io"}},
		{"$NAMESPACE", "team", []string{"--pool-name", "p"}, gateway.KubernetesConfig{Namespace: "team", InferencePool: "p"}},
		{"default", "", []string{"--pool-name", "p"}, gateway.KubernetesConfig{Namespace: "default", InferencePool: "p"}},
		{"over replicas:", "", []string{"--config", static, "--pool-name", "p"}, gateway.KubernetesConfig{Namespace: "default", InferencePool: "p"}},
		{"over the file's kubernetes", "team", []string{"--config", kube, "--pool-name", "p"},
			gateway.KubernetesConfig{Namespace: "llm", InferencePool: "p", RoleLabel: "tier", Kubeconfig: "/kc"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("NAMESPACE", tc.env)
			cfg, err := eppConfig(t, tc.args...)
			if err != nil {
				t.Fatal(err)
			}
			k := discoveredIn(cfg)
			if k == nil || *k != tc.want || len(cfg.Replicas) > 0 || cfg.ReplicasFile != "" {
				t.Fatalf("discovery %+v, replicas %v: want %+v", k, cfg.Replicas, tc.want)
			}
			if tc.name == "over the file's kubernetes" && cfg.Discovery.Scheme != "https" {
				t.Errorf("scheme %q: the file's discovery settings are kept", cfg.Discovery.Scheme)
			}
		})
	}
	if _, err := eppConfig(t, "--config", static, "--pool-namespace", "llm"); !errors.Is(err, errUsage) {
		t.Errorf("--pool-namespace alone: %v, want a usage error", err)
	}
	if _, err := eppConfig(t, "--pool-name", "Vllm_Pool"); err == nil || !strings.Contains(err.Error(), "discovery.kubernetes.inference_pool") {
		t.Errorf("a bad pool name: %v", err)
	}
}

// --check-config describes the pool as the source, contacting nothing.
func TestEPPCheckConfigPool(t *testing.T) {
	t.Setenv("KUBECONFIG", filepath.Join(t.TempDir(), "none"))
	code, out, errs := runCmd(t, "", "epp", "--check-config", "--pool-name", "vllm-pool", "--pool-namespace", "llm")
	want := "replicas of the InferencePool vllm-pool in namespace llm (inference.networking.k8s.io): its selector's Ready pods"
	if code != 0 || !strings.Contains(out, want) || !strings.Contains(out, "found while serving") {
		t.Fatalf("exit %d: %s%s", code, out, errs)
	}
	code, out, errs = runCmd(t, "", "serve", "--check-config", "--config",
		writeConfig(t, "discovery: {kubernetes: {namespace: llm, inference_pool: vllm-pool, selector: app=vllm}}\n"))
	if code != 2 || !strings.Contains(errs, "discovery.kubernetes.selector: with inference_pool") {
		t.Errorf("a selector beside the pool: exit %d, stdout %q, stderr %q", code, out, errs)
	}
}
