package workload

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseTenant(t *testing.T) {
	good := []struct {
		in   string
		want func(TenantSpec) bool
	}{
		{"name=A,rate=4", func(s TenantSpec) bool { return s.Name == "A" && s.Rate == 4 && s.Spec.Name == "random" }},
		{"name=B,workload=shared_prefix,requests=50,concurrency=32,priority=-1,key=sk-b,deadline=2s,groups=4",
			func(s TenantSpec) bool {
				return s.Spec.Name == "shared_prefix" && s.Spec.Requests == 50 && s.Concurrency == 32 && s.Priority == -1 &&
					s.Key == "sk-b" && s.Deadline == 2*time.Second && s.Spec.Params["groups"] == 4
			}},
		{"name=C,rate=1,input_len=3000,seed=9,weight=2.5", func(s TenantSpec) bool {
			return s.Spec.Params["input_len"] == 3000 && s.Spec.Seed == 9 && s.Weight == 2.5
		}},
	}
	for _, c := range good {
		s, err := ParseTenant(c.in)
		if err != nil || !c.want(s) {
			t.Errorf("%s: %+v %v", c.in, s, err)
		}
	}
	for _, bad := range []string{"rate=4", "name=A", "name=A,rate=-1", "name=A,rate=1,nope=3", "name=A,rate=1,priority=x",
		"name=A,rate=1,deadline=-1s", "name=A,rate=1,weight=0", "name=A,concurrency=0", "name=A,rate", "name=A,rate=1,input_len=0"} {
		if _, err := ParseTenant(bad); !errors.Is(err, ErrTenant) {
			t.Errorf("%s: %v, want ErrTenant", bad, err)
		}
	}
}

// Mix: each tenant's requests at its own rate, tagged, with its own
// prompts; merged by arrival with conversations' turns after their
// previous ones.
func TestMix(t *testing.T) {
	a, _ := ParseTenant("name=A,rate=10,requests=40,input_len=100")
	b, _ := ParseTenant("name=B,rate=1,priority=2,workload=multiturn,conversations=2,turns=2,system_prompt_len=50,deadline=1s")
	reqs, err := Mix([]TenantSpec{a, b}, 1)
	if err != nil {
		t.Fatal(err)
	}
	n := map[string]int{}
	texts := map[string]string{}
	for i, r := range reqs {
		n[r.Tenant]++
		if r.Index != i || (i > 0 && r.At < reqs[i-1].At) || (r.Prev >= i) {
			t.Fatalf("request %d: index %d at %v prev %d", i, r.Index, r.At, r.Prev)
		}
		if r.Prev >= 0 && reqs[r.Prev].Tenant != r.Tenant {
			t.Fatalf("request %d's previous turn is another tenant's", i)
		}
		if r.Tenant == "B" && (r.Priority != 2 || r.Deadline != time.Second) {
			t.Fatalf("B's request untagged: %+v", r)
		}
		texts[r.Text()] = r.Tenant
	}
	if n["A"] != 40 || n["B"] != 4 || len(texts) != 44 {
		t.Fatalf("counts %v, %d distinct prompts", n, len(texts))
	}
	last := reqs[len(reqs)-1].At
	if last < 3*time.Second || last > 10*time.Second {
		t.Fatalf("40 requests at 10/s end at %v", last)
	}
	if _, err := Mix([]TenantSpec{a, a}, 1); !errors.Is(err, ErrTenant) {
		t.Fatalf("a tenant twice: %v", err)
	}
}

// A recorded trace carries each request's tenant and priority, bounded.
func TestTraceTenantAndPriority(t *testing.T) {
	rec, err := parseRecord([]byte(`{"timestamp":1,"input_length":10,"output_length":2,"hash_ids":[7],"block_size":16,"tenant":"acme","priority":-2}`))
	if err != nil || rec.Tenant != "acme" || rec.Priority != -2 {
		t.Fatalf("%+v %v", rec, err)
	}
	reqs, _ := FromTrace([]TraceRecord{rec}, 1)
	if reqs[0].Tenant != "acme" || reqs[0].Priority != -2 {
		t.Fatalf("%+v", reqs[0])
	}
	for _, bad := range []string{`"priority":2000000`, `"tenant":"` + strings.Repeat("x", 200) + `"`, `"priority":"1"`} {
		if _, err := parseRecord([]byte(`{"timestamp":1,"input_length":10,"output_length":2,"hash_ids":[7],"block_size":16,` + bad + `}`)); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
