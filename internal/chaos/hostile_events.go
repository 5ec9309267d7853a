package chaos

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The KV-event door: replicas publish their KV events to one socket the
// gateway listens on (kv_events_listen, llm-d's topology), each
// connecting from its own address.

// chaosAdminToken opens the gateways' /debug/route to the suite.
const chaosAdminToken = "chaos-admin-token"

// kvListen is a tcp:// endpoint on a free loopback port.
func kvListen() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return "tcp://" + ln.Addr().String(), nil
}

// kvFleet starts replicas publishing to listen from each host given
// (one replica per host entry), with a cache large enough that the
// ordinary load evicts nothing, and one precise-mode gateway listening
// for their events; it waits until every replica's publisher is heard.
func (e *peerEnv) kvFleet(ctx context.Context, hosts ...string) (*peerGateway, string, error) {
	listen, err := kvListen()
	if err != nil {
		return nil, "", err
	}
	for _, h := range hosts {
		if _, err := e.startSims(ctx, sim.Config{Replicas: 1, Host: h, KVEvents: true, KVEventsConnect: listen,
			KVEventsReplay: true, KVBlocks: 1 << 16}); err != nil {
			return nil, "", err
		}
	}
	cfg := e.config(e.urls)
	cfg.Policy, cfg.Tokenizer, cfg.KVEventsListen, cfg.AdminToken = "precise", "remote", listen, chaosAdminToken
	for i, r := range e.sims {
		// vLLM's replay socket: a publisher joined late (its first batches
		// published before it connected) is followed from its start.
		cfg.Replicas[i].KVEventsReplay = r.KVReplayEndpoint()
	}
	pg, err := e.serve("gw", cfg, nil)
	if err != nil {
		return nil, "", err
	}
	if err := e.waitReady(ctx, pg); err != nil {
		return nil, "", err
	}
	if why := e.heard(ctx, pg, "connected"); why != "" {
		return nil, "", fmt.Errorf("before the attack: %s", why)
	}
	if err := testutil.Poll(ctx, 10*time.Second, func() bool {
		return metricSum(pg.reg, "kvgate_kv_events_synced") == float64(len(e.sims))
	}); err != nil {
		return nil, "", fmt.Errorf("before the attack, %v of %d replicas in sync: %w", metricSum(pg.reg, "kvgate_kv_events_synced"), len(e.sims), err)
	}
	return pg, listen, nil
}

// heard makes every replica publish (a new prompt sent to it directly)
// until the gateway counts a batch from it; "" when every one was heard
// within 10 s, else which were not. A publisher connects asynchronously
// and drops what it publishes before, so it posts again until heard.
func (e *peerEnv) heard(ctx context.Context, pg *peerGateway, tag string) string {
	hc := &http.Client{Transport: e.tr, Timeout: 5 * time.Second}
	var deaf []string
	for i, r := range e.sims {
		label := map[string]string{"replica": e.urls[i]}
		before := metricWith(pg.reg, "kvgate_kv_events_batches_total", label)
		n := 0
		err := testutil.Poll(ctx, 10*time.Second, func() bool {
			if metricWith(pg.reg, "kvgate_kv_events_batches_total", label) > before {
				return true
			}
			if n%25 == 0 { // every 50 ms
				_ = postPrompt(hc, r.URL(), "", fmt.Sprintf("chaos %s %s heard %d %d: ", e.kind, tag, i, n)+strings.Repeat("a new prompt to publish ", 8))
			}
			n++
			return false
		})
		if err != nil {
			deaf = append(deaf, e.urls[i])
		}
	}
	if len(deaf) > 0 {
		return fmt.Sprintf("no batch counted from %v", deaf)
	}
	return ""
}

// postPrompt sends a one-token completion of text to base (a replica or a
// gateway, with an API key when given) and reads the answer; "" when 200.
func postPrompt(hc *http.Client, base, key, text string) string {
	body, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "prompt": text, "max_tokens": 1})
	req, err := http.NewRequest(http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Sprintf("%d %.200s", resp.StatusCode, data)
	}
	return ""
}

// routed is the gateway's decision for a prompt (POST /debug/route): the
// replica chosen and the blocks each replica matches.
type routed struct {
	url   string
	match map[string]int
	busy  bool // some replica had requests running or waiting
}

func debugRoute(hc *http.Client, base, text string) (routed, error) {
	body, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "prompt": text, "max_tokens": 1})
	req, err := http.NewRequest(http.MethodPost, base+"/debug/route", bytes.NewReader(body))
	if err != nil {
		return routed{}, err
	}
	req.Header.Set("Authorization", "Bearer "+chaosAdminToken)
	resp, err := hc.Do(req)
	if err != nil {
		return routed{}, err
	}
	defer resp.Body.Close()
	var v struct {
		ReplicaURL string `json:"replica_url"`
		Replicas   []struct {
			URL      string `json:"url"`
			Match    int    `json:"match_blocks"`
			InFlight int    `json:"in_flight"`
			Running  *int   `json:"running"`
			Waiting  *int   `json:"waiting"`
		} `json:"replicas"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&v); err != nil || resp.StatusCode != http.StatusOK {
		return routed{}, fmt.Errorf("/debug/route answered %d: %v", resp.StatusCode, err)
	}
	out := routed{url: v.ReplicaURL, match: map[string]int{}}
	for _, r := range v.Replicas {
		out.match[r.URL] = r.Match
		out.busy = out.busy || r.InFlight > 0 || (r.Running != nil && *r.Running > 0) || (r.Waiting != nil && *r.Waiting > 0)
	}
	return out, nil
}

// eventPrompts are the forged-events scenario's fixed prompts, each
// cached by one replica (prompt k by replica k mod 3): 8 blocks of 16
// tokens, unique from the first block.
func eventPrompts(n int) []string {
	out := make([]string, n)
	for k := range out {
		out[k] = (fmt.Sprintf("chaos forged-events prompt %d:", k) + strings.Repeat(" the cache holds this prompt", 30))[:8*16*4]
	}
	return out
}

// routes are the gateway's decisions for texts once no replica is busy
// (the decision then depends on the index alone).
func routes(ctx context.Context, hc *http.Client, pg *peerGateway, texts []string) ([]routed, error) {
	var out []routed
	var last error
	err := testutil.Poll(ctx, 10*time.Second, func() bool {
		out, last = out[:0], nil
		for _, t := range texts {
			r, err := debugRoute(hc, pg.base, t)
			if err != nil || r.busy {
				last = err
				return false
			}
			out = append(out, r)
		}
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("the decisions of the fixed prompts (%v): %w", last, err)
	}
	return out, nil
}

// rawPub is a ZMQ PUB connection made by hand to the listening socket
// from a chosen loopback address, so that the forger sets every topic
// and sequence number (0: a "restart").
type rawPub struct {
	conn net.Conn
	zc   *zmq4.Conn
}

// dialPub connects from local to listen and completes the ZMTP handshake;
// an error when the gateway refused or closed the connection.
func dialPub(local, listen string) (*rawPub, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}, Timeout: 5 * time.Second}
	conn, err := d.Dial("tcp", strings.TrimPrefix(listen, "tcp://"))
	if err != nil {
		return nil, err
	}
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	zc, err := zmq4.Open(conn, null.Security(), zmq4.Pub, nil, false, nil)
	if err == nil {
		_, err = zc.RecvMsg() // the gateway's subscription
	}
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &rawPub{conn: conn, zc: zc}, nil
}

func (p *rawPub) send(topic string, seq uint64, b kvevents.Batch) error {
	frames, err := kvevents.EncodeFrames(topic, seq, b, kvevents.FormMap)
	if err != nil {
		return err
	}
	_ = p.conn.SetDeadline(time.Now().Add(5 * time.Second))
	return p.zc.SendMsg(zmq4.NewMsgFrom(frames...))
}

func (p *rawPub) close() { _ = p.conn.Close() }

// storedBatch is a batch storing every text's blocks from the root, as
// an engine that has just cached them reports it.
func storedBatch(clear bool, texts ...string) kvevents.Batch {
	var b kvevents.Batch
	if clear {
		b.Events = append(b.Events, &kvevents.AllBlocksCleared{})
	}
	for k, text := range texts {
		ids := prompt.Approx{}.Encode(nil, text)
		n := len(ids) / 16
		hs := make([]uint64, n)
		for j := range hs {
			hs[j] = uint64(1_000_000*(k+1) + j)
		}
		b.Events = append(b.Events, &kvevents.BlockStored{BlockHashes: hs, TokenIDs: ids[:n*16], BlockSize: 16, Medium: "GPU"})
	}
	return b
}

// kvTopic is a replica's topic, kv@HOST:PORT@MODEL.
func kvTopic(url string) string {
	return "kv@" + strings.TrimPrefix(url, "http://") + "@" + sim.DefaultModel
}

// eventForger is the forged-events attacker: from 127.0.0.2 (replica C's
// address) it publishes replica A "restarted" holding B's and C's prompts
// and B "restarted" empty, every 20 ms; from 127.0.0.3 (no replica's) it
// tries to connect every 200 ms.
type eventForger struct {
	listen, topicA, topicB string
	fromC, fromB           []string // the prompts of C and B

	mu                        sync.Mutex
	sent, dials, refused, err int
}

func (f *eventForger) run(ctx context.Context, rounds int) {
	var wg sync.WaitGroup
	wg.Go(func() {
		var p *rawPub
		defer func() {
			if p != nil {
				p.close()
			}
		}()
		forged := storedBatch(true, append(f.fromB, f.fromC...)...)
		every(ctx, 20*time.Millisecond, rounds, func() bool {
			if p == nil {
				var err error
				if p, err = dialPub("127.0.0.2", f.listen); err != nil {
					f.count(&f.err)
					return true
				}
			}
			if p.send(f.topicA, 0, forged) != nil || p.send(f.topicB, 0, storedBatch(true)) != nil {
				p.close()
				p = nil
				f.count(&f.err)
				return true
			}
			f.count(&f.sent)
			return true
		})
	})
	wg.Go(func() {
		every(ctx, 200*time.Millisecond, rounds/10+1, func() bool {
			f.count(&f.dials)
			if p, err := dialPub("127.0.0.3", f.listen); err != nil {
				f.count(&f.refused)
			} else {
				p.close()
			}
			return true
		})
	})
	wg.Wait()
}

func (f *eventForger) count(n *int) {
	f.mu.Lock()
	*n++
	f.mu.Unlock()
}

// runForgedEvents: replicas A and B on 127.0.0.1 and C on 127.0.0.2
// publish their KV events to the gateway (precise); nine prompts are
// cached three by each. A forger at 127.0.0.2 publishes A "restarted"
// with B's and C's prompts and B "restarted" empty while ordinary clients
// use the gateway; another at 127.0.0.3 tries to connect. No prompt's
// decision may change, during the attack or after it.
func runForgedEvents(ctx context.Context, e *peerEnv, res *Result) error {
	p := res.Peers
	p.Attack = "from 127.0.0.2 (replica C's address) a forger publishes replica A's topic restarted (sequence 0, AllBlocksCleared) " +
		"holding B's and C's prompts, and B's restarted empty, every 20 ms; from 127.0.0.3 (no replica's) another connects every 200 ms"
	pg, listen, err := e.kvFleet(ctx, "127.0.0.1", "127.0.0.1", "127.0.0.2")
	if err != nil {
		return err
	}
	hc := &http.Client{Transport: e.tr, Timeout: 5 * time.Second}
	texts := eventPrompts(9)
	homes := make([]string, len(texts))
	f := &eventForger{listen: listen, topicA: kvTopic(e.urls[0]), topicB: kvTopic(e.urls[1])}
	for k, t := range texts {
		homes[k] = e.urls[k%3]
		if why := postPrompt(hc, homes[k], "", t); why != "" {
			return fmt.Errorf("warming prompt %d on %s: %s", k, homes[k], why)
		}
		switch k % 3 {
		case 1:
			f.fromB = append(f.fromB, t)
		case 2:
			f.fromC = append(f.fromC, t)
		}
	}
	if err := testutil.Poll(ctx, 20*time.Second, func() bool {
		for k, t := range texts {
			if r, err := debugRoute(hc, pg.base, t); err != nil || r.match[homes[k]] < 8 {
				return false
			}
		}
		return true
	}); err != nil {
		return fmt.Errorf("the fixed prompts were not indexed on their replicas: %w", err)
	}
	before, err := routes(ctx, hc, pg, texts)
	if err != nil {
		return err
	}
	drops := func() float64 {
		return metricWith(pg.reg, "kvgate_kv_events_dropped_total", map[string]string{"reason": "peer_address"})
	}
	var during []routed
	var duringErr error
	var deaf string
	results := e.attack(ctx, e.clients(pg), func(actx context.Context) { f.run(actx, e.attackRounds(20*time.Millisecond)) }, func() {
		// The forger still publishing: once more of its batches were
		// dropped, every real publisher is heard and no decision moved.
		d0 := drops()
		_ = testutil.Poll(ctx, 10*time.Second, func() bool { return drops() >= d0+2 })
		deaf = e.heard(ctx, pg, "under attack")
		during, duringErr = routes(ctx, hc, pg, texts)
	})
	if duringErr != nil {
		return duringErr
	}
	after, err := routes(ctx, hc, pg, texts)
	if err != nil {
		return err
	}
	e.account(res, names(pg), results)
	forgedEventsVerdict(p, pg, f, homes, before, during, after, deaf)
	return nil
}

// forgedEventsVerdict compares the decisions of the fixed prompts before,
// during and after the attack, and checks the door's counts.
func forgedEventsVerdict(p *PeerAccount, pg *peerGateway, f *eventForger, homes []string, before, during, after []routed, deaf string) {
	for _, phase := range []struct {
		name string
		rs   []routed
	}{{"before the attack", before}, {"under attack", during}, {"after it", after}} {
		moved, credited := 0, 0
		for k, r := range phase.rs {
			if r.url != before[k].url {
				moved++
			}
			for u, m := range r.match {
				if u != homes[k] && m > before[k].match[u] {
					credited++
				}
			}
		}
		p.figure("%s: the %d fixed prompts go to %s; %d moved, %d credited to another replica", phase.name, len(phase.rs), spread(phase.rs, homes), moved, credited)
		p.check(moved == 0, "%s: %d of %d fixed prompts moved to another replica", phase.name, moved, len(phase.rs))
		p.check(credited == 0, "%s: %d fixed prompts' blocks credited to another replica", phase.name, credited)
	}
	f.mu.Lock()
	sent, errs, dials, refused := f.sent, f.err, f.dials, f.refused
	f.mu.Unlock()
	dropped := metricWith(pg.reg, "kvgate_kv_events_dropped_total", map[string]string{"reason": "peer_address"})
	closed := metricWith(pg.reg, "kvgate_kv_events_connections_closed_total", map[string]string{"reason": "peer_address"})
	synced := metricSum(pg.reg, "kvgate_kv_events_synced")
	p.figure("forger at 127.0.0.2: %d rounds of 2 forged batches sent (%d reconnections); dropped with reason peer_address: %v; drops by reason: %s",
		sent, errs, dropped, byLabel(pg.reg, "kvgate_kv_events_dropped_total", "reason"))
	p.figure("forger at 127.0.0.3: %d connections tried, %d refused; connections closed by reason: %s; replicas in sync after: %v of 3",
		dials, refused, byLabel(pg.reg, "kvgate_kv_events_connections_closed_total", "reason"), synced)
	p.check(sent > 0 && dropped > 0, "the forger's batches were not seen dropped (sent %d, dropped %v)", sent, dropped)
	p.check(dials > 0 && refused == dials && closed > 0, "the forger at 127.0.0.3 was let in (%d of %d refused, %v closed)", refused, dials, closed)
	p.check(synced == 3, "%v of 3 replicas in sync after the attack", synced)
	p.check(deaf == "", "a real publisher was not heard under attack: %s", deaf)
}

// spread counts decisions by replica: "A 3, B 3, C 3" in homes' order.
func spread(rs []routed, homes []string) string {
	var order []string
	n := map[string]int{}
	for _, h := range homes {
		if _, ok := n[h]; !ok {
			order = append(order, h)
			n[h] = 0
		}
	}
	for _, r := range rs {
		if _, ok := n[r.url]; !ok {
			order = append(order, r.url)
		}
		n[r.url]++
	}
	parts := make([]string, len(order))
	for i, u := range order {
		parts[i] = fmt.Sprintf("%s %d", strings.TrimPrefix(u, "http://"), n[u])
	}
	return strings.Join(parts, ", ")
}

// The huge-frames attack's shape (finding 3): 24 peers announcing 64 MiB
// frames, and 1,024 idle peers.
const (
	hugePeers  = 24
	hugeFrame  = 64 << 20
	idlePeers  = 1024
	heapBudget = 256 << 20 // the heap's growth allowed under attack (24 × 64 MiB without the cap)
)

// hugeHeader is a ZMTP long frame's header announcing hugeFrame bytes with
// more frames to follow, and the first 4 KiB of it.
var hugeHeader = append(binary.BigEndian.AppendUint64([]byte{0x03}, hugeFrame), make([]byte, 4096)...)

// frameFlood is the huge-frames attacker's tally.
type frameFlood struct {
	mu                          sync.Mutex
	huge, hugeCut, idle, idleIn int
	conns                       []net.Conn // the idle peers', closed at the end
}

// hugeRound has hugePeers peers at the replicas' address complete the
// handshake and announce a 64 MiB frame each; it counts those the gateway
// cut (their connection closed within 10 s).
func (f *frameFlood) hugeRound(listen string) {
	var wg sync.WaitGroup
	for range hugePeers {
		wg.Go(func() {
			p, err := dialPub("127.0.0.1", listen)
			if err != nil {
				return // refused: the address's connections are all taken
			}
			defer p.close()
			f.add(&f.huge)
			if _, err := p.conn.Write(hugeHeader); err != nil {
				f.add(&f.hugeCut)
				return
			}
			_ = p.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			var ne net.Error
			if _, err := io.Copy(io.Discard, p.conn); !errors.As(err, &ne) || !ne.Timeout() {
				f.add(&f.hugeCut) // EOF or a reset: closed
			}
		})
	}
	wg.Wait()
}

// idleFlood opens idlePeers connections from 127.0.0.2 (no replica's
// address) and sends nothing; it counts those still open a moment later.
func (f *frameFlood) idleFlood(ctx context.Context, listen string) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: 5 * time.Second}
	for range idlePeers {
		if ctx.Err() != nil {
			return
		}
		c, err := d.DialContext(ctx, "tcp", strings.TrimPrefix(listen, "tcp://"))
		if err != nil {
			continue
		}
		f.add(&f.idle)
		f.mu.Lock()
		f.conns = append(f.conns, c)
		f.mu.Unlock()
	}
	for _, c := range f.conns {
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		var one [1]byte
		var ne net.Error
		if _, err := c.Read(one[:]); errors.As(err, &ne) && ne.Timeout() {
			f.add(&f.idleIn) // still open: the gateway kept it
		}
	}
}

func (f *frameFlood) add(n *int) {
	f.mu.Lock()
	*n++
	f.mu.Unlock()
}

func (f *frameFlood) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.conns {
		_ = c.Close()
	}
}

// runHugeFrames: three replicas on 127.0.0.1 publish their KV events to
// the gateway; while ordinary clients use it, peers at the replicas'
// address announce 64 MiB frames, round after round, and 1,024 idle peers
// connect from 127.0.0.2. The heap stays within heapBudget of where it
// was, and every real publisher is heard under attack.
func runHugeFrames(ctx context.Context, e *peerEnv, res *Result) error {
	p := res.Peers
	p.Attack = fmt.Sprintf("%d peers at the replicas' address announce %d MiB frames, round after round, and %d idle peers connect from 127.0.0.2",
		hugePeers, hugeFrame>>20, idlePeers)
	pg, listen, err := e.kvFleet(ctx, "127.0.0.1", "127.0.0.1", "127.0.0.1")
	if err != nil {
		return err
	}
	runtime.GC()
	base := readGauges()
	f := &frameFlood{}
	defer f.close()
	var deaf string
	var top gauges
	rounds := 0
	results := e.attack(ctx, e.clients(pg), func(actx context.Context) {
		gctx, stop := context.WithCancel(context.Background())
		peakOf := peak(gctx, 10*time.Millisecond)
		var wg sync.WaitGroup
		wg.Go(func() { f.idleFlood(actx, listen) })
		every(actx, 250*time.Millisecond, e.attackRounds(250*time.Millisecond), func() bool {
			f.hugeRound(listen)
			rounds++
			return true
		})
		wg.Wait()
		stop()
		top = peakOf()
	}, func() { deaf = e.heard(ctx, pg, "under attack") })
	e.account(res, names(pg), results)
	grew := int64(top.heap) - int64(base.heap)
	p.figure("%d rounds: %d peers announced a %d MiB frame, %d of them cut; %d idle peers connected from 127.0.0.2, %d still open after 200 ms",
		rounds, f.huge, hugeFrame>>20, f.hugeCut, f.idle, f.idleIn)
	p.figure("connections closed by reason: %s", byLabel(pg.reg, "kvgate_kv_events_connections_closed_total", "reason"))
	p.figure("heap in use: %d MiB before, %d MiB at most under attack (%+d MiB; the process's, replicas and clients included); fds at most %d, goroutines at most %d",
		base.heap>>20, top.heap>>20, grew>>20, top.fds, top.goroutines)
	p.check(f.huge > 0 && f.hugeCut == f.huge, "%d of %d peers announcing %d MiB frames were cut", f.hugeCut, f.huge, hugeFrame>>20)
	p.check(f.idle > 0 && f.idleIn == 0, "%d of %d idle peers from 127.0.0.2 kept a connection", f.idleIn, f.idle)
	p.check(grew < heapBudget, "the heap grew by %d MiB under attack, more than %d MiB", grew>>20, heapBudget>>20)
	p.check(deaf == "", "a real publisher was not heard under attack: %s", deaf)
	return nil
}
