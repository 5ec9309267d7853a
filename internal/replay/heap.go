package replay

import "time"

// event is one entry of the event queue. Events at the same virtual time are
// handled in the order they were scheduled (seq), which makes a run a pure
// function of its inputs.
type event struct {
	at   time.Duration
	seq  uint64
	kind uint8
	arg  int32
}

func (a *event) before(b *event) bool {
	return a.at < b.at || (a.at == b.at && a.seq < b.seq)
}

// eventHeap is a binary min-heap of events by (at, seq), written out for the
// concrete type: container/heap's interface calls cost more than the
// comparisons themselves on the millions of step events of a long trace.
type eventHeap struct {
	ev  []event
	seq uint64
}

func (h *eventHeap) len() int { return len(h.ev) }

func (h *eventHeap) top() *event { return &h.ev[0] }

func (h *eventHeap) push(at time.Duration, kind uint8, arg int32) {
	h.seq++
	h.ev = append(h.ev, event{at: at, seq: h.seq, kind: kind, arg: arg})
	// Sift up.
	i := len(h.ev) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h.ev[i].before(&h.ev[p]) {
			break
		}
		h.ev[i], h.ev[p] = h.ev[p], h.ev[i]
		i = p
	}
}

func (h *eventHeap) pop() event {
	top := h.ev[0]
	n := len(h.ev) - 1
	h.ev[0] = h.ev[n]
	h.ev = h.ev[:n]
	// Sift down.
	i := 0
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && h.ev[r].before(&h.ev[l]) {
			m = r
		}
		if !h.ev[m].before(&h.ev[i]) {
			break
		}
		h.ev[i], h.ev[m] = h.ev[m], h.ev[i]
		i = m
	}
	return top
}

// fifo is a queue of items in flight for the same delay: since every item is
// delayed equally, they arrive in the order they left, and the heap only
// needs to carry a "deliver the oldest" event.
type fifo[T any] struct {
	buf  []T
	head int
}

func (q *fifo[T]) push(v T) {
	// Compact once the consumed head dominates, so the buffer stays bounded
	// by the items in flight.
	if q.head > 64 && q.head*2 >= len(q.buf) {
		n := copy(q.buf, q.buf[q.head:])
		clear(q.buf[n:])
		q.buf, q.head = q.buf[:n], 0
	}
	q.buf = append(q.buf, v)
}

func (q *fifo[T]) pop() T {
	var zero T
	v := q.buf[q.head]
	q.buf[q.head] = zero
	q.head++
	return v
}

func (q *fifo[T]) len() int { return len(q.buf) - q.head }
