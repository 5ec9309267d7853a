//go:build !nokubernetes

package main

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kvgate/kvgate/internal/gateway"
)

// k8sObject is the part of a Kubernetes object the manifests' test reads;
// spec is decoded by kind.
type k8sObject struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels"`
	} `json:"metadata"`
	Data     map[string]string `json:"data"` // ConfigMap
	Spec     json.RawMessage   `json:"spec"`
	Rules    []k8sRule         `json:"rules"` // Role
	RoleRef  struct{ Kind, Name string }
	Subjects []struct{ Kind, Name, Namespace string }
	file     string
}

type k8sRule struct {
	APIGroups []string `json:"apiGroups"`
	Resources []string `json:"resources"`
	Verbs     []string `json:"verbs"`
}

type k8sSelector struct {
	MatchLabels map[string]string `json:"matchLabels"`
}

// k8sWorkload is a Deployment's or StatefulSet's spec.
type k8sWorkload struct {
	Replicas    int         `json:"replicas"`
	ServiceName string      `json:"serviceName"`
	Selector    k8sSelector `json:"selector"`
	Template    struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
		Spec k8sPod `json:"spec"`
	} `json:"template"`
}

type k8sPod struct {
	ServiceAccountName            string `json:"serviceAccountName"`
	TerminationGracePeriodSeconds *int   `json:"terminationGracePeriodSeconds"`
	SecurityContext               struct {
		RunAsNonRoot *bool `json:"runAsNonRoot"`
		RunAsUser    int   `json:"runAsUser"`
	} `json:"securityContext"`
	Containers []k8sContainer `json:"containers"`
	Volumes    []struct {
		Name      string `json:"name"`
		ConfigMap *struct {
			Name string `json:"name"`
		} `json:"configMap"`
	} `json:"volumes"`
}

type k8sContainer struct {
	Name    string   `json:"name"`
	Image   string   `json:"image"`
	Command []string `json:"command"`
	Args    []string `json:"args"`
	Ports   []struct {
		Name          string `json:"name"`
		ContainerPort int    `json:"containerPort"`
	} `json:"ports"`
	Env []struct {
		Name      string `json:"name"`
		ValueFrom *struct {
			FieldRef *struct {
				FieldPath string `json:"fieldPath"`
			} `json:"fieldRef"`
		} `json:"valueFrom"`
	} `json:"env"`
	ReadinessProbe, LivenessProbe *k8sProbe
	SecurityContext               struct {
		ReadOnlyRootFilesystem   *bool `json:"readOnlyRootFilesystem"`
		AllowPrivilegeEscalation *bool `json:"allowPrivilegeEscalation"`
	} `json:"securityContext"`
	Resources struct {
		Requests map[string]string `json:"requests"`
		Limits   map[string]string `json:"limits"`
	} `json:"resources"`
	Lifecycle struct {
		PreStop *struct {
			Sleep *struct {
				Seconds int `json:"seconds"`
			} `json:"sleep"`
		} `json:"preStop"`
	} `json:"lifecycle"`
	VolumeMounts []struct {
		Name      string `json:"name"`
		MountPath string `json:"mountPath"`
	} `json:"volumeMounts"`
}

type k8sProbe struct {
	HTTPGet *struct {
		Path string          `json:"path"`
		Port json.RawMessage `json:"port"`
	} `json:"httpGet"`
}

type k8sService struct {
	ClusterIP string            `json:"clusterIP"`
	Selector  map[string]string `json:"selector"`
	Ports     []struct {
		Name       string          `json:"name"`
		Port       int             `json:"port"`
		TargetPort json.RawMessage `json:"targetPort"`
	} `json:"ports"`
}

// loadManifests parses every YAML document of every file under
// deploy/kubernetes, each of which must name its apiVersion, kind and name.
func loadManifests(t *testing.T) []k8sObject { return loadManifestsIn(t, "kubernetes") }

// loadManifestsIn is loadManifests of deploy/DIR.
func loadManifestsIn(t *testing.T, dir string) []k8sObject {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(repoRoot(t), "deploy", dir, "*"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests under deploy/%s: %v", dir, err)
	}
	var out []k8sObject
	for _, f := range files {
		if ext := filepath.Ext(f); ext != ".yaml" && ext != ".yml" {
			t.Errorf("%s: not a .yaml file; kubectl apply -f deploy/%s would skip or refuse it", f, dir)
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range regexp.MustCompile(`(?m)^---[ \t]*$`).Split(string(data), -1) {
			if strings.TrimSpace(regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(doc, "")) == "" {
				continue // comments only
			}
			var o k8sObject
			if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
				t.Fatalf("%s, document %d: %v", f, i+1, err)
			}
			o.file = filepath.Base(f)
			if o.APIVersion == "" || o.Kind == "" || o.Metadata.Name == "" {
				t.Fatalf("%s, document %d: apiVersion %q, kind %q, metadata.name %q: each is required", f, i+1, o.APIVersion, o.Kind, o.Metadata.Name)
			}
			out = append(out, o)
		}
	}
	return out
}

// find returns the one object of kind and name.
func find(t *testing.T, objs []k8sObject, kind, name string) k8sObject {
	t.Helper()
	for _, o := range objs {
		if o.Kind == kind && o.Metadata.Name == name {
			return o
		}
	}
	t.Fatalf("no %s %q among the manifests", kind, name)
	return k8sObject{}
}

func specOf[T any](t *testing.T, o k8sObject) T {
	t.Helper()
	var s T
	if err := json.Unmarshal(o.Spec, &s); err != nil {
		t.Fatalf("%s %s (%s): spec: %v", o.Kind, o.Metadata.Name, o.file, err)
	}
	return s
}

func container(t *testing.T, p k8sPod, name string) k8sContainer {
	t.Helper()
	for _, c := range p.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return k8sContainer{}
}

// containerPort resolves a probe's or Service's port (a number or a port name).
func containerPort(t *testing.T, c k8sContainer, raw json.RawMessage) int {
	t.Helper()
	var n int
	if json.Unmarshal(raw, &n) == nil {
		return n
	}
	var name string
	if err := json.Unmarshal(raw, &name); err != nil {
		t.Fatalf("port %s: %v", raw, err)
	}
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	t.Fatalf("container %s has no port named %q", c.Name, name)
	return 0
}

// matches reports whether labels carry every label of sel.
func matches(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false // an empty selector selects everything: never what these manifests mean
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// kvgateDeployment is the kvgate Deployment's spec and container.
func kvgateDeployment(t *testing.T, objs []k8sObject) (k8sWorkload, k8sContainer) {
	t.Helper()
	d := specOf[k8sWorkload](t, find(t, objs, "Deployment", "kvgate"))
	return d, container(t, d.Template.Spec, "kvgate")
}

// deployedConfigs are the configurations the kvgate container can run
// with: its command line (after /kvgate) parsed by serve's own flag parsing,
// with --config the file it names in the ConfigMap volume mounted there
// (deployed), or any other file of that ConfigMap (by key).
func deployedConfigs(t *testing.T, objs []k8sObject) (deployed string, cfgs map[string]gateway.Config) {
	t.Helper()
	d, c := kvgateDeployment(t, objs)
	if len(c.Command) < 2 || c.Command[1] != "serve" {
		t.Fatalf("kvgate's command %v: want [BINARY serve]", c.Command)
	}
	args := slices.Concat(c.Command[2:], c.Args)
	i := slices.Index(args, "--config")
	if i < 0 || i+1 >= len(args) {
		t.Fatalf("kvgate's args %v: no --config FILE", args)
	}
	dir, file := path.Split(args[i+1])
	var volume, cmName string
	for _, m := range c.VolumeMounts {
		if path.Clean(m.MountPath) == path.Clean(dir) {
			volume = m.Name
		}
	}
	for _, v := range d.Template.Spec.Volumes {
		if v.Name == volume && v.ConfigMap != nil {
			cmName = v.ConfigMap.Name
		}
	}
	data := find(t, objs, "ConfigMap", cmName).Data
	if _, ok := data[file]; !ok {
		t.Fatalf("ConfigMap %s has no key %q for --config %s", cmName, file, args[i+1])
	}
	cfgs = map[string]gateway.Config{}
	for key, text := range data {
		args[i+1] = writeConfig(t, text)
		cfg, err := serveConfig(t, args...)
		if err != nil {
			t.Fatalf("ConfigMap %s, %s: kvgate serve %v: %v", cmName, key, args, err)
		}
		cfgs[key] = cfg
	}
	return file, cfgs
}

// Every manifest parses; the gateway's configuration from the ConfigMap
// passes `kvgate serve --check-config`; the container serves on the port
// its probes, Service and ServiceMonitor use; the pod outlives the drain.
func TestKubernetesManifests(t *testing.T) {
	objs := loadManifests(t)
	deployed, cfgs := deployedConfigs(t, objs)
	for key, cfg := range cfgs {
		if err := checkConfig(cfg); err != nil {
			t.Errorf("the ConfigMap's %s fails --check-config: %v", key, err)
		}
		if k := discoveredIn(cfg); k != nil {
			checkRBAC(t, objs, kvgateServiceAccount(t, objs), k.Namespace, "discovery.k8s.io", "endpointslices")
		}
	}
	cfg := cfgs[deployed]
	d, c := kvgateDeployment(t, objs)
	if d.Replicas < 2 || !matches(d.Selector.MatchLabels, d.Template.Metadata.Labels) {
		t.Errorf("Deployment: replicas %d (want ≥ 2), selector %v over labels %v", d.Replicas, d.Selector.MatchLabels, d.Template.Metadata.Labels)
	}
	stages := dockerStages(t, readDockerfile(t))
	if entry := entrypoint(t, stages[len(stages)-1]); c.Command[0] != entry[0] {
		t.Errorf("command %v runs %s; the image's binary is %s (Dockerfile)", c.Command, c.Command[0], entry[0])
	}
	_, listenPort, _ := strings.Cut(cfg.Listen, ":")
	port := 0
	for _, p := range c.Ports {
		if strconv.Itoa(p.ContainerPort) == listenPort {
			port = p.ContainerPort
		}
	}
	if port == 0 {
		t.Fatalf("no containerPort for the config's listen %s: %+v", cfg.Listen, c.Ports)
	}
	checkProbes(t, c, port)
	checkPodLifetime(t, d.Template.Spec, c, cfg)
	checkService(t, objs, d, c, port)
	checkRBAC(t, objs, d.Template.Spec.ServiceAccountName, find(t, objs, "Deployment", "kvgate").Metadata.Namespace,
		"discovery.k8s.io", "endpointslices")
	checkNamespaces(t, objs)
}

// discoveredIn is a configuration's Kubernetes discovery, or nil.
func discoveredIn(cfg gateway.Config) *gateway.KubernetesConfig {
	if cfg.Discovery == nil {
		return nil
	}
	return cfg.Discovery.Kubernetes
}

func kvgateServiceAccount(t *testing.T, objs []k8sObject) string {
	t.Helper()
	d, _ := kvgateDeployment(t, objs)
	return d.Template.Spec.ServiceAccountName
}

// checkProbes: readiness on /ready and liveness on /health, both on the
// serving port, and both paths (and /metrics) served by a gateway.
func checkProbes(t *testing.T, c k8sContainer, port int) {
	t.Helper()
	for _, p := range []struct {
		name  string
		probe *k8sProbe
		path  string
	}{{"readinessProbe", c.ReadinessProbe, "/ready"}, {"livenessProbe", c.LivenessProbe, "/health"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s: want httpGet %s", p.name, p.path)
			continue
		}
		if got := containerPort(t, c, p.probe.HTTPGet.Port); got != port {
			t.Errorf("%s on port %d, the gateway listens on %d", p.name, got, port)
		}
	}
	for path, want := range gatewayPaths(t, "/ready", "/health", "/metrics") {
		if want == http.StatusNotFound {
			t.Errorf("the gateway answers %s with 404", path)
		}
	}
}

// gatewayPaths is the status a gateway (one replica, never run) answers
// for each path: 404 for a path it does not serve.
func gatewayPaths(t *testing.T, paths ...string) map[string]int {
	t.Helper()
	up := httptest.NewServer(http.NotFoundHandler())
	defer up.Close()
	cfg := gateway.Defaults()
	cfg.Replicas = []gateway.ReplicaConfig{{URL: up.URL, DataParallelSize: 1}}
	g, err := gateway.New(cfg, gateway.Options{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	defer srv.Close()
	out := map[string]int{}
	for _, p := range paths {
		resp, err := http.Get(srv.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		out[p] = resp.StatusCode
	}
	return out
}

// checkPodLifetime: non-root with a read-only root; the grace period covers
// the preStop pause and the drain, so a drain is never cut by SIGKILL.
func checkPodLifetime(t *testing.T, p k8sPod, c k8sContainer, cfg gateway.Config) {
	t.Helper()
	if p.SecurityContext.RunAsNonRoot == nil || !*p.SecurityContext.RunAsNonRoot || p.SecurityContext.RunAsUser == 0 {
		t.Errorf("pod securityContext: want runAsNonRoot and a non-zero runAsUser")
	}
	sc := c.SecurityContext
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("container securityContext: want readOnlyRootFilesystem, no privilege escalation")
	}
	if c.Resources.Requests["cpu"] == "" || c.Resources.Requests["memory"] == "" || c.Resources.Limits["memory"] == "" {
		t.Errorf("resources: want cpu and memory requests and a memory limit: %+v", c.Resources)
	}
	pause := time.Duration(0)
	if ps := c.Lifecycle.PreStop; ps != nil && ps.Sleep != nil {
		pause = time.Duration(ps.Sleep.Seconds) * time.Second
	}
	grace := 30 * time.Second // Kubernetes' default
	if p.TerminationGracePeriodSeconds != nil {
		grace = time.Duration(*p.TerminationGracePeriodSeconds) * time.Second
	}
	if grace <= pause+cfg.DrainTimeout.D() {
		t.Errorf("terminationGracePeriodSeconds %v: want more than the preStop pause %v plus drain_timeout %v", grace, pause, cfg.DrainTimeout.D())
	}
}

// checkService: the Service selects the gateway's pods and targets its
// port; the ServiceMonitor scrapes that Service's port on /metrics; the
// PodDisruptionBudget covers the pods.
func checkService(t *testing.T, objs []k8sObject, d k8sWorkload, c k8sContainer, port int) {
	t.Helper()
	svcObj := find(t, objs, "Service", "kvgate")
	svc := specOf[k8sService](t, svcObj)
	if !matches(svc.Selector, d.Template.Metadata.Labels) || len(svc.Ports) == 0 || containerPort(t, c, svc.Ports[0].TargetPort) != port {
		t.Errorf("Service kvgate: selector %v, ports %+v: want the gateway's pods on port %d", svc.Selector, svc.Ports, port)
	}
	sm := specOf[struct {
		Selector  k8sSelector
		Endpoints []struct{ Port, Path string }
	}](t, find(t, objs, "ServiceMonitor", "kvgate"))
	if !matches(sm.Selector.MatchLabels, svcObj.Metadata.Labels) || len(sm.Endpoints) == 0 ||
		sm.Endpoints[0].Port != svc.Ports[0].Name || sm.Endpoints[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor kvgate: %+v: want the Service's port %q on /metrics", sm, svc.Ports[0].Name)
	}
	pdb := specOf[struct {
		MinAvailable json.RawMessage `json:"minAvailable"`
		Selector     k8sSelector
	}](t, find(t, objs, "PodDisruptionBudget", "kvgate"))
	if !matches(pdb.Selector.MatchLabels, d.Template.Metadata.Labels) || len(pdb.MinAvailable) == 0 {
		t.Errorf("PodDisruptionBudget: %+v: want minAvailable over the gateway's pods", pdb)
	}
}

// checkRBAC: the pods' ServiceAccount may get, list and watch the
// resource of group in namespace ns (discovery: {kubernetes: ...}).
func checkRBAC(t *testing.T, objs []k8sObject, sa, ns, group, resource string) {
	t.Helper()
	find(t, objs, "ServiceAccount", sa)
	for _, rb := range objs {
		if rb.Kind != "RoleBinding" || rb.Metadata.Namespace != ns || !slices.ContainsFunc(rb.Subjects, func(s struct{ Kind, Name, Namespace string }) bool {
			return s.Kind == "ServiceAccount" && s.Name == sa
		}) {
			continue
		}
		role := find(t, objs, rb.RoleRef.Kind, rb.RoleRef.Name)
		if role.Metadata.Namespace != ns {
			continue
		}
		for _, r := range role.Rules {
			if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) &&
				!slices.ContainsFunc([]string{"get", "list", "watch"}, func(v string) bool { return !slices.Contains(r.Verbs, v) }) {
				return
			}
		}
	}
	t.Errorf("no RoleBinding gives ServiceAccount %s get, list and watch on %q %s in namespace %s", sa, group, resource, ns)
}

// checkNamespaces: every namespaced object is in the Namespace the
// manifests create.
func checkNamespaces(t *testing.T, objs []k8sObject) {
	t.Helper()
	var ns []string
	for _, o := range objs {
		if o.Kind == "Namespace" {
			ns = append(ns, o.Metadata.Name)
		}
	}
	for _, o := range objs {
		if o.Kind != "Namespace" && !slices.Contains(ns, o.Metadata.Namespace) {
			t.Errorf("%s %s (%s): namespace %q is not among the manifests' %v", o.Kind, o.Metadata.Name, o.file, o.Metadata.Namespace, ns)
		}
	}
}

// argValue is flag name's value in args (--name=V or --name V).
func argValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

// vllmFleet is what the vLLM example offers kvgate: the StatefulSet, its
// headless Service, vLLM's container and its serving port.
type vllmFleet struct {
	obj    k8sObject
	sts    k8sWorkload
	svcObj k8sObject
	svc    k8sService
	c      k8sContainer
	port   string // vLLM's --port
	evPort string // its KV-event publisher's bound port
	rpPort string // its replay socket's
	topic  string
}

// readVLLMExample checks the example's own shape: a headless Service over
// the StatefulSet's pods, prefix caching on, KV events bound on ports the
// container declares.
func readVLLMExample(t *testing.T, objs []k8sObject) vllmFleet {
	t.Helper()
	var f vllmFleet
	f.obj = find(t, objs, "StatefulSet", "vllm")
	f.sts = specOf[k8sWorkload](t, f.obj)
	f.svcObj = find(t, objs, "Service", f.sts.ServiceName)
	f.svc = specOf[k8sService](t, f.svcObj)
	if f.svc.ClusterIP != "None" || !matches(f.svc.Selector, f.sts.Template.Metadata.Labels) {
		t.Fatalf("Service %s: want headless (clusterIP: None) over the StatefulSet's pods", f.sts.ServiceName)
	}
	f.c = container(t, f.sts.Template.Spec, "vllm")
	if !slices.Contains(f.c.Args, "--enable-prefix-caching") {
		t.Errorf("vLLM args %v: no --enable-prefix-caching", f.c.Args)
	}
	f.port, _ = argValue(f.c.Args, "--port")
	raw, _ := argValue(f.c.Args, "--kv-events-config")
	var kv struct {
		Enable    bool   `json:"enable_kv_cache_events"`
		Publisher string `json:"publisher"`
		Endpoint  string `json:"endpoint"`
		Replay    string `json:"replay_endpoint"`
		Topic     string `json:"topic"`
	}
	if err := json.Unmarshal([]byte(raw), &kv); err != nil || !kv.Enable || kv.Publisher != "zmq" {
		t.Fatalf("--kv-events-config %q: want enable_kv_cache_events and the zmq publisher: %v", raw, err)
	}
	var okE, okR bool
	f.evPort, okE = strings.CutPrefix(kv.Endpoint, "tcp://*:")
	f.rpPort, okR = strings.CutPrefix(kv.Replay, "tcp://*:")
	if !okE || !okR {
		t.Fatalf("vLLM binds its publisher and replay sockets (tcp://*:PORT) for every gateway pod: %q %q", kv.Endpoint, kv.Replay)
	}
	f.topic = kv.Topic
	for _, p := range []string{f.port, f.evPort, f.rpPort} {
		if !slices.ContainsFunc(f.c.Ports, func(cp struct {
			Name          string `json:"name"`
			ContainerPort int    `json:"containerPort"`
		}) bool {
			return strconv.Itoa(cp.ContainerPort) == p
		}) {
			t.Errorf("vLLM container: no containerPort %s", p)
		}
	}
	return f
}

// The vLLM example pairs with every configuration of the ConfigMap: the
// same block size, and its replicas either discovered (the EndpointSlices
// of its Service, in its namespace, on vLLM's port) or listed (the
// StatefulSet's pods by their DNS names, on vLLM's port, with the KV-event
// and replay endpoints vLLM binds). The deployed configuration discovers
// them; another lists them for precise mode.
func TestKubernetesVLLMExample(t *testing.T) {
	objs := loadManifests(t)
	deployed, cfgs := deployedConfigs(t, objs)
	f := readVLLMExample(t, objs)
	bs, _ := argValue(f.c.Args, "--block-size")
	var precise int
	for key, cfg := range cfgs {
		if bs != strconv.Itoa(cfg.BlockSize) {
			t.Errorf("%s: vLLM --block-size %q, kvgate's block_size %d", key, bs, cfg.BlockSize)
		}
		switch k := discoveredIn(cfg); {
		case k != nil:
			checkDiscovered(t, key, k, f)
		case len(cfg.Replicas) > 0:
			checkListed(t, key, cfg, f)
			if cfg.Precise() {
				precise++
			}
		default:
			t.Errorf("%s: the replicas are neither discovered from Kubernetes nor listed", key)
		}
	}
	if discoveredIn(cfgs[deployed]) == nil || precise == 0 {
		t.Errorf("want the deployed %s to discover the replicas, and a precise-mode alternative listing them (%d)", deployed, precise)
	}
}

// checkDiscovered: the selector picks the EndpointSlices of the vLLM
// Service (a slice carries its Service's labels and
// kubernetes.io/service-name), in its namespace, on the port vLLM serves.
func checkDiscovered(t *testing.T, key string, k *gateway.KubernetesConfig, f vllmFleet) {
	t.Helper()
	sliceLabels := maps.Clone(f.svcObj.Metadata.Labels)
	if sliceLabels == nil {
		sliceLabels = map[string]string{}
	}
	sliceLabels["kubernetes.io/service-name"] = f.svcObj.Metadata.Name
	sel := map[string]string{}
	for _, term := range strings.Split(k.Selector, ",") {
		name, value, ok := strings.Cut(strings.TrimSpace(term), "=")
		if !ok || strings.ContainsAny(name+value, "!=() ") {
			t.Fatalf("%s: selector %q: this test reads only name=value terms", key, k.Selector)
		}
		sel[name] = value
	}
	if k.Namespace != f.obj.Metadata.Namespace || !matches(sel, sliceLabels) {
		t.Errorf("%s: discovery %+v does not select Service %s/%s's EndpointSlices (labels %v)", key, k,
			f.obj.Metadata.Namespace, f.svcObj.Metadata.Name, sliceLabels)
	}
	port := string(k.Port)
	for _, sp := range f.svc.Ports {
		if sp.Name == port {
			port = strconv.Itoa(containerPort(t, f.c, sp.TargetPort))
		}
	}
	if port != f.port {
		t.Errorf("%s: discovery port %q is %s, vLLM serves on %s", key, k.Port, port, f.port)
	}
}

// checkListed: the listed replicas are the StatefulSet's pods by their DNS
// names, with the endpoints vLLM binds; the topic names each as its URL.
func checkListed(t *testing.T, key string, cfg gateway.Config, f vllmFleet) {
	t.Helper()
	if len(cfg.Replicas) != f.sts.Replicas {
		t.Fatalf("%s lists %d replicas, the StatefulSet runs %d", key, len(cfg.Replicas), f.sts.Replicas)
	}
	for i, r := range cfg.Replicas {
		host := fmt.Sprintf("%s-%d.%s.%s.svc.cluster.local", f.obj.Metadata.Name, i, f.sts.ServiceName, f.obj.Metadata.Namespace)
		want := gateway.ReplicaConfig{URL: "http://" + host + ":" + f.port, KVEvents: "tcp://" + host + ":" + f.evPort,
			KVEventsReplay: "tcp://" + host + ":" + f.rpPort}
		if r != want {
			t.Errorf("%s: replicas[%d] = %+v, want %+v", key, i, r, want)
		}
		topic := strings.ReplaceAll(f.topic, "$(POD_NAME)", fmt.Sprintf("%s-%d", f.obj.Metadata.Name, i))
		if !strings.HasPrefix(topic, "kv@"+host+":"+f.port+"@") {
			t.Errorf("topic %q does not name replica %s", topic, r.URL)
		}
	}
}

// k8sNetworkPolicy is a NetworkPolicy's spec (ingress only).
type k8sNetworkPolicy struct {
	PodSelector k8sSelector `json:"podSelector"`
	PolicyTypes []string    `json:"policyTypes"`
	Ingress     []struct {
		From []struct {
			PodSelector       *k8sSelector `json:"podSelector"`
			NamespaceSelector *k8sSelector `json:"namespaceSelector"`
			IPBlock           *struct {
				CIDR string `json:"cidr"`
			} `json:"ipBlock"`
		} `json:"from"`
		Ports []struct {
			Port     json.RawMessage `json:"port"`
			Protocol string          `json:"protocol"`
		} `json:"ports"`
	} `json:"ingress"`
}

// admitted is, per container port of the pods with labels, who the
// NetworkPolicies selecting them admit: "*" anyone, "pods:NAME" the pods
// of app.kubernetes.io/name NAME (in the namespace), "namespace:..." and
// "ipBlock:..." others. A port absent is closed once a policy selects the
// pods; nil when none does (all open).
func admitted(t *testing.T, objs []k8sObject, labels map[string]string, c k8sContainer) map[int][]string {
	t.Helper()
	var out map[int][]string
	for _, o := range objs {
		if o.Kind != "NetworkPolicy" {
			continue
		}
		np := specOf[k8sNetworkPolicy](t, o)
		if o.APIVersion != "networking.k8s.io/v1" || !slices.Contains(np.PolicyTypes, "Ingress") {
			t.Errorf("NetworkPolicy %s: want networking.k8s.io/v1 with policyTypes [Ingress]", o.Metadata.Name)
		}
		if !matches(np.PodSelector.MatchLabels, labels) {
			continue
		}
		if out == nil {
			out = map[int][]string{}
		}
		for _, rule := range np.Ingress {
			var who []string
			for _, f := range rule.From {
				switch {
				case f.IPBlock != nil:
					who = append(who, "ipBlock:"+f.IPBlock.CIDR)
				case f.NamespaceSelector != nil:
					who = append(who, fmt.Sprint("namespace:", f.NamespaceSelector.MatchLabels))
				case f.PodSelector != nil && len(f.PodSelector.MatchLabels) == 1 && f.PodSelector.MatchLabels["app.kubernetes.io/name"] != "":
					who = append(who, "pods:"+f.PodSelector.MatchLabels["app.kubernetes.io/name"])
				default:
					t.Fatalf("NetworkPolicy %s: a peer this test does not read: %+v", o.Metadata.Name, f)
				}
			}
			if len(rule.From) == 0 {
				who = []string{"*"}
			}
			if len(rule.Ports) == 0 {
				t.Fatalf("NetworkPolicy %s: a rule for every port; name them", o.Metadata.Name)
			}
			for _, p := range rule.Ports {
				port := containerPort(t, c, p.Port)
				out[port] = append(out[port], who...)
			}
		}
	}
	return out
}

// Finding 6 (issue 22): vLLM's replay socket serves every cached prompt's
// token ids to whoever asks, and its PUB socket streams them. A
// NetworkPolicy admits only the gateway pods to both (and the gateways and
// Prometheus to vLLM's API), and only the vLLM pods to the gateway's
// KV-event port, whose socket a pod binds on its own address ($(POD_IP)).
func TestKubernetesNetworkPolicies(t *testing.T) {
	objs := loadManifests(t)
	f := readVLLMExample(t, objs)
	d, gw := kvgateDeployment(t, objs)
	gwName := d.Template.Metadata.Labels["app.kubernetes.io/name"]
	vName := f.sts.Template.Metadata.Labels["app.kubernetes.io/name"]
	vllm := admitted(t, objs, f.sts.Template.Metadata.Labels, f.c)
	if vllm == nil {
		t.Fatal("no NetworkPolicy selects the vLLM pods: their KV-event and replay sockets are open to every pod")
	}
	for _, p := range []string{f.evPort, f.rpPort} {
		n, _ := strconv.Atoi(p)
		if who := vllm[n]; !slices.Equal(who, []string{"pods:" + gwName}) {
			t.Errorf("vLLM's port %d (KV events or replay) admits %v, want the gateway pods only", n, who)
		}
	}
	api, _ := strconv.Atoi(f.port)
	if who := vllm[api]; !slices.Contains(who, "pods:"+gwName) || slices.Contains(who, "*") {
		t.Errorf("vLLM's API port %d admits %v: want the gateways (and monitoring), not everyone", api, who)
	}
	kv := 0
	for _, p := range gw.Ports {
		if p.Name == "kv-events" {
			kv = p.ContainerPort
		}
	}
	gate := admitted(t, objs, d.Template.Metadata.Labels, gw)
	if kv == 0 || gate == nil || !slices.Equal(gate[kv], []string{"pods:" + vName}) {
		t.Errorf("the gateway's kv-events port %d admits %v, want the vLLM pods only", kv, gate[kv])
	}
	http := containerPort(t, gw, json.RawMessage(`"http"`))
	if !slices.Contains(gate[http], "*") {
		t.Errorf("the gateway's API port %d admits %v, want every client", http, gate[http])
	}
	podIP := false
	for _, e := range gw.Env {
		podIP = podIP || (e.Name == "POD_IP" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP")
	}
	if !podIP {
		t.Error("the gateway has no POD_IP from status.podIP to bind --kv-events-listen=tcp://$(POD_IP):PORT on the pod's own address")
	}
	cfg, err := serveConfig(t, "--replicas", "http://10.0.0.1:8000", "--tokenizer", "remote",
		"--kv-events-listen", fmt.Sprintf("tcp://$(POD_IP):%d", kv))
	if err != nil || checkConfig(cfg) != nil || !strings.HasSuffix(cfg.KVEventsListen, fmt.Sprint(":", kv)) {
		t.Errorf("kvgate serve --kv-events-listen tcp://$(POD_IP):%d: %v", kv, err)
	}
}
