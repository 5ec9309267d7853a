package sim

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/testutil"
)

// postModel sends a one-token completion for model to rank of r.
func postModel(t *testing.T, c *http.Client, r *Replica, model string, rank int, text string) {
	t.Helper()
	resp := testutil.Post(t, c, r.URL()+"/v1/completions",
		`{"model":"`+model+`","prompt":`+jsonString(text)+`,"max_tokens":1}`,
		HeaderDataParallelRank, strconv.Itoa(rank))
	decodeCompletion(t, resp)
}

// replayAll asks a replay endpoint for everything from sequence number 0.
func replayAll(t *testing.T, ep string) ([]kvevents.Message, kvzmq.ReplayResult) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var ms []kvevents.Message
	res, err := kvzmq.Replay(ctx, ep, 0, func(m kvevents.Message) { ms = append(ms, m) })
	if err != nil {
		t.Fatalf("Replay %s: %v", ep, err)
	}
	return ms, res
}

// Each rank's replay socket (vLLM's replay_endpoint), on rank 0's port +
// k, serves the batches its rank published before anyone subscribed, from
// the first sequence number (KVEventsFirstSeq) on, each with its rank.
func TestKVEventsReplay(t *testing.T) {
	for _, firstSeq := range []uint64{0, 1} {
		t.Run("first seq "+strconv.FormatUint(firstSeq, 10), func(t *testing.T) {
			cfg := fast()
			cfg.KVEvents, cfg.KVEventsReplay, cfg.KVEventsFirstSeq, cfg.DataParallelSize = true, true, firstSeq, 2
			cfg.ServedModelNames = []string{"alias"} // the topic names the model, not this
			f := startFleet(t, cfg)
			r, c := f.Replicas()[0], testClient(t)
			if want := "kv@" + strings.TrimPrefix(r.URL(), "http://") + "@" + DefaultModel; r.KVTopic() != want {
				t.Errorf("topic %q, want %q", r.KVTopic(), want)
			}
			reps := r.KVReplayEndpoints()
			if len(reps) != 2 || reps[0] != r.KVReplayEndpoint() || reps[1] != kvevents.OffsetPort(reps[0], 1) ||
				f.KVReplayEndpoints()[0] != reps[0] {
				t.Fatalf("replay endpoints %q (rank 0 %q, fleet %q), want two on consecutive ports",
					reps, r.KVReplayEndpoint(), f.KVReplayEndpoints())
			}
			// No subscriber: the batches are only in the replay buffers.
			texts := [][]string{{words("ra", 48), words("rb", 48)}, {words("rc", 48)}}
			for rank, ts := range texts {
				for _, text := range ts {
					postModel(t, c, r, "alias", rank, text)
				}
			}
			for rank, ep := range reps {
				// A batch is published just after its step's outputs are
				// delivered, so the last one may trail the answer.
				var ms []kvevents.Message
				var res kvzmq.ReplayResult
				testutil.Eventually(t, 10*time.Second, "rank "+strconv.Itoa(rank)+"'s batches in its replay buffer", func() bool {
					ms, res = replayAll(t, ep)
					last := texts[rank][len(texts[rank])-1]
					return len(ms) > 0 && stores(ms[len(ms)-1], DefaultModel, last)
				})
				if res.First != firstSeq || res.Last != firstSeq+uint64(len(ms))-1 || res.Batches != len(ms) {
					t.Errorf("rank %d: replayed %d batches, seq %d..%d, want from %d", rank, res.Batches, res.First, res.Last, firstSeq)
				}
				found := 0
				for i, m := range ms {
					if m.Seq != firstSeq+uint64(i) || m.Batch.DataParallelRank == nil || *m.Batch.DataParallelRank != rank {
						t.Fatalf("rank %d: batch %d has seq %d and rank %s", rank, i, m.Seq, ptrString(m.Batch.DataParallelRank))
					}
					for _, text := range texts[rank] {
						if stores(m, DefaultModel, text) {
							found++
						}
					}
					for _, text := range texts[1-rank] {
						if stores(m, DefaultModel, text) {
							t.Errorf("rank %d's replay holds a block stored by rank %d", rank, 1-rank)
						}
					}
				}
				if found != len(texts[rank]) {
					t.Errorf("rank %d: %d of its %d prompts' blocks replayed", rank, found, len(texts[rank]))
				}
			}
		})
	}
}

// listenRanks binds n KV-event listeners on consecutive ports, as a router
// does for the ranks of connecting replicas; each message goes to msgs
// with the listener's index.
func listenRanks(t *testing.T, n int, msgs chan<- rankMessage) string {
	t.Helper()
	for range 20 {
		var ls []*kvzmq.Listener
		base := 0
		for k := range n {
			l, err := kvzmq.Listen(context.Background(), "tcp://127.0.0.1:"+strconv.Itoa(base+k),
				func(m kvevents.Message) { msgs <- rankMessage{k, m} }, kvzmq.ListenOptions{})
			if err != nil {
				break
			}
			ls = append(ls, l)
			if k == 0 {
				base = l.Addr().(*net.TCPAddr).Port
			}
		}
		if len(ls) == n {
			t.Cleanup(func() {
				for _, l := range ls {
					_ = l.Close()
				}
			})
			return "tcp://127.0.0.1:" + strconv.Itoa(base)
		}
		for _, l := range ls {
			_ = l.Close()
		}
	}
	t.Fatal("no consecutive free ports")
	return ""
}

// rankMessage is a message and the index of the listener it reached.
type rankMessage struct {
	listener int
	msg      kvevents.Message
}

// In connect mode a replica's publisher dials from the host it serves on,
// as vLLM dials from its pod's address: a gateway that checks where a
// publisher connects from (kv_events_trust) sees the replica's own host.
func TestKVEventsConnectFromTheReplicaHost(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cfg := fast()
	cfg.Host, cfg.KVEvents, cfg.KVEventsConnect = "127.0.0.2", true, "tcp://"+ln.Addr().String()
	startFleet(t, cfg)
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(20 * time.Second))
	conn, err := ln.Accept()
	if err != nil {
		t.Fatalf("the publisher never connected: %v", err)
	}
	defer conn.Close()
	if got := conn.RemoteAddr().(*net.TCPAddr).IP.String(); got != "127.0.0.2" {
		t.Fatalf("the publisher of a replica on 127.0.0.2 connected from %s", got)
	}
}

// In connect mode every replica's rank k dials the consumer's port + k, and
// the topic kv@<replica address>@<model> tells the replicas apart; nothing
// is bound.
func TestKVEventsConnect(t *testing.T) {
	msgs := make(chan rankMessage, 10000)
	ep := listenRanks(t, 2, msgs)
	cfg := fast()
	cfg.Replicas, cfg.DataParallelSize = 2, 2
	cfg.KVEvents, cfg.KVEventsConnect, cfg.KVEventsFirstSeq, cfg.KVEventsReplay = true, ep, 1, true
	cfg.Model, cfg.ServedModelNames = "org/base-8b", []string{"alias"}
	f := startFleet(t, cfg)
	c := testClient(t)
	type source struct{ replica, rank int }
	byTopic := map[string]int{}
	for i, r := range f.Replicas() {
		want := "kv@" + strings.TrimPrefix(r.URL(), "http://") + "@org/base-8b"
		reps := r.KVReplayEndpoints()
		if r.KVTopic() != want || r.KVEndpoint() != "" || r.KVEndpoints() != nil ||
			len(reps) != 2 || reps[1] != kvevents.OffsetPort(reps[0], 1) {
			t.Fatalf("replica %d: topic %q (want %q), endpoint %q %q, replay %q", i, r.KVTopic(), want,
				r.KVEndpoint(), r.KVEndpoints(), reps)
		}
		byTopic[want] = i
	}
	// The publishers connect asynchronously: post to every rank until each
	// has delivered a batch (batches before the connection are dropped).
	seen := map[source]bool{}
	deadline := time.Now().Add(20 * time.Second)
	for n := 0; len(seen) < 4; n++ {
		if time.Now().After(deadline) {
			t.Fatalf("batches from %v only", seen)
		}
		for i, r := range f.Replicas() {
			for k := range 2 {
				if !seen[source{i, k}] {
					postModel(t, c, r, "alias", k, words("c"+strconv.Itoa(n%100), 16))
				}
			}
		}
		wait := time.After(20 * time.Millisecond) // retry interval while the connections come up
	drain:
		for {
			select {
			case m := <-msgs:
				i, ok := byTopic[m.msg.Topic]
				rank := m.msg.Batch.DataParallelRank
				if !ok || rank == nil || *rank != m.listener {
					t.Fatalf("listener %d got topic %q rank %s", m.listener, m.msg.Topic, ptrString(rank))
				}
				if m.msg.Seq < 1 {
					t.Fatalf("seq %d below the first, 1", m.msg.Seq)
				}
				seen[source{i, *rank}] = true
			case <-wait:
				break drain
			}
		}
	}
}

// Ephemeral KV-event and replay ports come in runs of consecutive ports,
// one per rank, so that rank k's is rank 0's port + k.
func TestKVEventsConsecutivePorts(t *testing.T) {
	cfg := fast()
	cfg.Replicas, cfg.DataParallelSize = 2, 3
	cfg.KVEvents, cfg.KVEventsReplay = true, true
	f := startFleet(t, cfg)
	for i, r := range f.Replicas() {
		for _, eps := range [][]string{r.KVEndpoints(), r.KVReplayEndpoints()} {
			if len(eps) != 3 {
				t.Fatalf("replica %d: endpoints %q", i, eps)
			}
			for k, ep := range eps {
				if ep != kvevents.OffsetPort(eps[0], k) {
					t.Errorf("replica %d: rank %d on %s, want rank 0's port + %d (%s)", i, k, ep, k, eps[0])
				}
				conn, err := net.Dial("tcp", strings.TrimPrefix(ep, "tcp://"))
				if err != nil {
					t.Errorf("replica %d rank %d: %s not listening: %v", i, k, ep, err)
					continue
				}
				_ = conn.Close()
			}
		}
	}
}

// When port + k is taken, the ranks start over on new ephemeral ports, and
// what the failed attempt opened is closed (goleak checks its goroutines).
func TestOpenRanksRetries(t *testing.T) {
	cfg := fast().withDefaults()
	open := rankOpener(t.Context(), cfg, "t")
	var blocker net.Listener
	attempts, firstPort := 0, 0
	pubs, err := openRanks(3, 0, 0, func(k, pubPort, replayPort int) (rankPublisher, error) {
		if k == 0 {
			attempts++
		}
		if k == 1 && attempts == 1 {
			// Take rank 1's PUB port (if nobody has it already).
			firstPort = pubPort - 1
			blocker, _ = net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(pubPort))
		}
		return open(k, pubPort, replayPort)
	})
	if blocker != nil {
		defer blocker.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, p := range pubs {
			_ = p.Close()
		}
	}()
	if attempts < 2 || len(pubs) != 3 {
		t.Fatalf("%d attempts, %d publishers", attempts, len(pubs))
	}
	base := pubs[0].Addr().(*net.TCPAddr).Port
	rbase := pubs[0].ReplayAddr().(*net.TCPAddr).Port
	for k, p := range pubs {
		if got, rgot := p.Addr().(*net.TCPAddr).Port, p.ReplayAddr().(*net.TCPAddr).Port; got != base+k || rgot != rbase+k {
			t.Errorf("rank %d on ports %d and %d, want %d and %d", k, got, rgot, base+k, rbase+k)
		}
	}
	// The first attempt's rank 0 let its port go.
	if firstPort < base || firstPort > base+2 {
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(firstPort))
		if err != nil {
			t.Errorf("first attempt's port %d still bound: %v", firstPort, err)
		} else {
			_ = ln.Close()
		}
	}

	// Fixed ports are not retried: a taken one is an error at once, and
	// what was opened is closed.
	attempts = 0
	var opened []*fakePub
	_, err = openRanks(2, 9000, -1, func(k, pubPort, replayPort int) (rankPublisher, error) {
		if k == 0 {
			attempts++
			opened = append(opened, &fakePub{port: pubPort})
			return opened[len(opened)-1], nil
		}
		return nil, errors.New("taken")
	})
	if err == nil || attempts != 1 || !opened[0].closed {
		t.Errorf("fixed ports: %d attempts, error %v, rank 0 closed %v", attempts, err, opened[0].closed)
	}
}

// fakePub is a rankPublisher bound nowhere.
type fakePub struct {
	port   int
	closed bool
}

func (p *fakePub) Publish(kvevents.Batch) error { return nil }
func (p *fakePub) Close() error                 { p.closed = true; return nil }
func (p *fakePub) Addr() net.Addr               { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: p.port} }
func (p *fakePub) ReplayAddr() net.Addr         { return nil }

// The KV-event options are checked by Start.
func TestKVEventsConfigErrors(t *testing.T) {
	ev := func(c Config) Config { c.KVEvents = true; return c }
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"ports with ranks", ev(Config{Replicas: 2, DataParallelSize: 2, KVEventsPort: 65533}), "65533..65536"},
		{"ranks overlap HTTP", ev(Config{Replicas: 2, DataParallelSize: 2, Port: 9003, KVEventsPort: 9000}), "overlap"},
		{"replay overlaps events", ev(Config{Replicas: 1, DataParallelSize: 2, KVEventsPort: 9000,
			KVEventsReplay: true, KVEventsReplayPort: 9001}), "overlap"},
		{"replay ports", ev(Config{Replicas: 1, DataParallelSize: 4, KVEventsReplay: true, KVEventsReplayPort: 65533}), "replay"},
		{"replay without events", Config{Replicas: 1, KVEventsReplay: true}, "without KV events"},
		{"connect without events", Config{Replicas: 1, KVEventsConnect: "tcp://127.0.0.1:5557"}, "without KV events"},
		{"connect and port", ev(Config{Replicas: 1, KVEventsPort: 5557, KVEventsConnect: "tcp://127.0.0.1:5557"}), "exclude"},
		{"connect wildcard", ev(Config{Replicas: 1, KVEventsConnect: "tcp://*:5557"}), "wildcard"},
		{"connect unspecified", ev(Config{Replicas: 1, KVEventsConnect: "tcp://0.0.0.0:5557"}), "wildcard"},
		{"connect no scheme", ev(Config{Replicas: 1, KVEventsConnect: "127.0.0.1:5557"}), "tcp://HOST:PORT"},
		{"connect ipc", ev(Config{Replicas: 1, KVEventsConnect: "ipc:///tmp/kv"}), "tcp://HOST:PORT"},
		{"connect port with ranks", ev(Config{Replicas: 1, DataParallelSize: 2, KVEventsConnect: "tcp://127.0.0.1:65535"}), "out of range"},
		{"connect port 0", ev(Config{Replicas: 1, KVEventsConnect: "tcp://127.0.0.1:0"}), "out of range"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := Start(t.Context(), tc.cfg)
			if err == nil {
				_ = f.Close()
				t.Fatal("started")
			}
			if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want ErrInvalidConfig mentioning %q", err, tc.want)
			}
		})
	}
}
