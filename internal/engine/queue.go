package engine

// seqDeque is the waiting queue: a ring buffer of requests, FCFS, with O(1)
// push at both ends (new requests at the back, preempted ones at the front)
// and O(n) removal in the middle (aborts and out-of-order arrivals, both rare).
type seqDeque struct {
	buf  []*seq
	head int
	n    int
}

func (d *seqDeque) len() int { return d.n }

func (d *seqDeque) at(i int) *seq { return d.buf[(d.head+i)%len(d.buf)] }

func (d *seqDeque) set(i int, s *seq) { d.buf[(d.head+i)%len(d.buf)] = s }

func (d *seqDeque) grow() {
	if d.n < len(d.buf) {
		return
	}
	nb := make([]*seq, max(16, 2*len(d.buf)))
	for i := range d.n {
		nb[i] = d.at(i)
	}
	d.buf, d.head = nb, 0
}

func (d *seqDeque) pushBack(s *seq) {
	d.grow()
	d.n++
	d.set(d.n-1, s)
}

func (d *seqDeque) pushFront(s *seq) {
	d.grow()
	d.head = (d.head - 1 + len(d.buf)) % len(d.buf)
	d.n++
	d.set(0, s)
}

func (d *seqDeque) front() *seq { return d.at(0) }

func (d *seqDeque) popFront() *seq {
	s := d.at(0)
	d.set(0, nil)
	d.head = (d.head + 1) % len(d.buf)
	d.n--
	return s
}

// insert puts s at position i (0 ≤ i ≤ len), shifting the tail back.
func (d *seqDeque) insert(i int, s *seq) {
	d.grow()
	d.n++
	for j := d.n - 1; j > i; j-- {
		d.set(j, d.at(j-1))
	}
	d.set(i, s)
}

// remove deletes position i, shifting the tail forward.
func (d *seqDeque) remove(i int) {
	for j := i; j < d.n-1; j++ {
		d.set(j, d.at(j+1))
	}
	d.set(d.n-1, nil)
	d.n--
}

// index is the position of s, or -1.
func (d *seqDeque) index(s *seq) int {
	for i := range d.n {
		if d.at(i) == s {
			return i
		}
	}
	return -1
}
