package discovery

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// This package's tests do not link internal/discovery/kubernetes: the
// kind answers that the binary was built without it, naming the tag.
func TestKindNotLinked(t *testing.T) {
	if Kubernetes.Linked() {
		t.Fatal("linked without its package")
	}
	errs := Kubernetes.Validate(KubernetesConfig{Namespace: "llm", Selector: "a=b", Port: "http"})
	_, err := Kubernetes.New(KubernetesConfig{})
	for _, e := range []error{errors.Join(errs...), err} {
		var nl *NotLinkedError
		if !errors.As(e, &nl) || !strings.HasPrefix(e.Error(), "discovery.kubernetes: this kvgate was built without "+
			"Kubernetes discovery (build tag nokubernetes); build it without -tags nokubernetes") {
			t.Fatalf("got %v", e)
		}
	}
	if len(errs) != 1 {
		t.Fatalf("%d errors: %v", len(errs), errs)
	}
}

type nameSource string

func (n nameSource) Name() string                                  { return string(n) }
func (nameSource) Run(ctx context.Context, update func([]Replica)) {}

// A registered kind validates and builds through its plugin; the errors
// name discovery.KIND.KEY and discovery.KIND.
func TestKindRegistered(t *testing.T) {
	k := Kind[string]{name: "testkind", title: "Test", tag: "notest"}
	Register(k, Plugin[string]{
		Validate: func(c string) []error {
			if c == "bad" {
				return []error{errors.New(`selector "bad": no`), errors.New("port: no")}
			}
			return nil
		},
		New: func(c string) (Source, error) {
			if c == "" {
				return nil, errors.New("no kubeconfig")
			}
			return nameSource(c), nil
		}})
	t.Cleanup(func() { delete(plugins, "testkind") })
	if !k.Linked() || len(k.Validate("good")) != 0 {
		t.Fatal("a registered kind is not linked, or refuses a good configuration")
	}
	if errs := k.Validate("bad"); len(errs) != 2 || errs[0].Error() != `discovery.testkind.selector "bad": no` ||
		errs[1].Error() != "discovery.testkind.port: no" {
		t.Fatalf("errors %v", errs)
	}
	if src, err := k.New("x"); err != nil || src.Name() != "x" {
		t.Fatalf("%v %v", src, err)
	}
	if _, err := k.New(""); err == nil || err.Error() != "discovery.testkind: no kubeconfig" {
		t.Fatalf("error %v", err)
	}
}
