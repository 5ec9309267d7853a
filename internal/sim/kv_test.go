package sim

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// kvLog collects a replica's KV events from its ZMQ publisher.
type kvLog struct {
	msgs chan kvevents.Message
	gaps chan [2]uint64
	sub  *kvzmq.Subscriber
}

func subscribeKV(t testing.TB, r *Replica) *kvLog {
	t.Helper()
	return subscribeKVAt(t, r.KVEndpoint(), r.KVTopic())
}

// subscribeKVAt collects the KV events published on endpoint under topic.
func subscribeKVAt(t testing.TB, endpoint, topic string) *kvLog {
	t.Helper()
	l := &kvLog{msgs: make(chan kvevents.Message, 10000), gaps: make(chan [2]uint64, 100)}
	sub, err := kvzmq.Subscribe(context.Background(), endpoint, topic,
		func(m kvevents.Message) { l.msgs <- m },
		func(want, got uint64) { l.gaps <- [2]uint64{want, got} })
	if err != nil {
		t.Fatalf("Subscribe: %v", err)
	}
	l.sub = sub
	t.Cleanup(func() { _ = sub.Close() })
	return l
}

// warmUp sends distinct one-block prompts until the subscriber receives a
// batch (a ZMQ subscription takes effect asynchronously), then drains. It
// returns the prompts it sent.
func (l *kvLog) warmUp(t testing.TB, post func(string)) (sent []string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		sent = append(sent, words(fmt.Sprintf("w%02d", i%100), 16))
		post(sent[len(sent)-1])
		select {
		case <-l.msgs:
			for len(l.msgs) > 0 {
				<-l.msgs
			}
			return sent
		case <-time.After(20 * time.Millisecond): // retry interval while the subscription propagates
		}
		if time.Now().After(deadline) {
			t.Fatal("no KV events received")
		}
	}
}

// next returns the next batch, failing after a deadline.
func (l *kvLog) next(t testing.TB) kvevents.Message {
	t.Helper()
	select {
	case m := <-l.msgs:
		return m
	case <-time.After(testutil.Bound(10 * time.Second)):
		t.Fatal("no KV event batch")
	}
	return kvevents.Message{}
}

// The replica publishes vLLM's KV events: BlockStored with the engine's
// hashes (engine namespace, so unlike the router's), whose token ids hash
// back to them, and BlockRemoved for what eviction drops, in both wire forms.
func TestKVEvents(t *testing.T) {
	for _, form := range []kvevents.Form{kvevents.FormMap, kvevents.FormArray} {
		t.Run(form.String(), func(t *testing.T) {
			cfg := fast()
			cfg.KVEvents, cfg.KVEventsForm = true, form
			cfg.KVBlocks = 24 // 384 tokens: a second 200-token prompt evicts the first
			f := startFleet(t, cfg)
			rep := f.Replicas()[0]
			c := testClient(t)
			send := func(text string) {
				decodeCompletion(t, testutil.Post(t, c, rep.URL()+"/v1/completions",
					`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":1}`))
			}
			l := subscribeKV(t, rep)
			root := prompt.RootOf("engine", prompt.Key{Model: "sim-llama-8b"})
			warm := map[uint64]bool{} // stored before the replay starts
			for _, w := range l.warmUp(t, send) {
				warm[prompt.ApproxBlockHashes(nil, root, w, 16)[0]] = true
			}
			held := map[uint64]bool{} // replay of the events
			stored := map[uint64]bool{}
			var lastSeq uint64
			collect := func(text string) (st []uint64, rm []uint64) {
				send(text)
				want := prompt.ApproxBlockHashes(nil, root, text, 16)
				for len(st) == 0 || st[len(st)-1] != want[len(want)-1] { // until its last block is stored
					m := l.next(t)
					if m.Topic != rep.KVTopic() || (lastSeq != 0 && m.Seq != lastSeq+1) {
						t.Fatalf("topic %q seq %d after %d", m.Topic, m.Seq, lastSeq)
					}
					lastSeq = m.Seq
					for _, ev := range m.Batch.Events {
						switch ev := ev.(type) {
						case *kvevents.BlockStored:
							// The token ids hash, from the parent (or the
							// root), to exactly the published hashes.
							parent := root
							if ev.ParentBlockHash != nil {
								parent = *ev.ParentBlockHash
							}
							got := prompt.BlockHashes(nil, parent, prompt.TokenBytes(nil, ev.TokenIDs), ev.BlockSize)
							if !slices.Equal(got, ev.BlockHashes) || ev.BlockSize != 16 || ev.Medium != "GPU" {
								t.Fatalf("stored event does not hash to its blocks: %+v", ev)
							}
							for _, h := range ev.BlockHashes {
								if held[h] {
									t.Fatalf("hash %x stored twice", h)
								}
								held[h], stored[h] = true, true
							}
							st = append(st, ev.BlockHashes...)
						case *kvevents.BlockRemoved:
							for _, h := range ev.BlockHashes {
								if !held[h] && !warm[h] {
									t.Fatalf("removed %x never stored", h)
								}
								delete(held, h)
							}
							rm = append(rm, ev.BlockHashes...)
						default:
							t.Fatalf("unexpected event %T", ev)
						}
					}
				}
				return st, rm
			}
			a := words("aaa", 200)
			st, _ := collect(a)
			if want := prompt.ApproxBlockHashes(nil, root, a, 16); !slices.Equal(st, want) || len(want) != 12 {
				t.Fatalf("stored %d hashes, want the prompt's %d blocks", len(st), len(want))
			}
			// The router's hashes (kvgate namespace) are not the engine's.
			if routerH := prompt.ApproxBlockHashes(nil, prompt.Key{Model: "sim-llama-8b"}.Root(), a, 16); stored[routerH[0]] {
				t.Fatal("engine hashes equal the router's")
			}
			_, rm := collect(words("bbb", 200))
			if len(rm) == 0 {
				t.Fatal("no BlockRemoved after overfilling the cache")
			}
			if len(held) > cfg.KVBlocks {
				t.Errorf("%d blocks held by the replay, cache has %d", len(held), cfg.KVBlocks)
			}
			if st := rep.Stats(); st.CachedBlocks < len(held)-1 || st.EvictedBlocks == 0 {
				t.Errorf("engine has %d cached blocks, replay %d", st.CachedBlocks, len(held))
			}
			select {
			case g := <-l.gaps:
				t.Errorf("sequence gap %v", g)
			default:
			}
		})
	}
}
