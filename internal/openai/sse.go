package openai

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// DefaultMaxLine bounds one SSE line. A chunk of one token is a few hundred
// bytes; a chunk with the usage or a long tool call a few KiB; the largest
// legitimate lines are final chunks with logprobs of many tokens, well
// under 1 MiB.
const DefaultMaxLine = 1 << 20

// ErrLineTooLong is returned when a line (or an event) exceeds the
// reader's bound: the stream is treated as broken, not buffered further.
var ErrLineTooLong = errors.New("openai: SSE line longer than the bound")

// Event is one server-sent event: its raw bytes as received (lines and the
// blank line that ends it) and the data of its "data:" lines joined by
// newlines. Both are valid only until the next call to Next.
type Event struct {
	Raw  []byte
	Data []byte
	// HasData: the event had at least one data line.
	HasData bool
	// Unterminated: the stream ended inside this event (no blank line).
	Unterminated bool
}

// EventReader reads server-sent events with bounded memory.
type EventReader struct {
	br      *bufio.Reader
	maxLine int
	raw     bytes.Buffer
	data    bytes.Buffer
	err     error
}

// NewEventReader reads events from r; maxLine ≤ 0 means DefaultMaxLine.
// An event may hold at most 4 × maxLine bytes.
func NewEventReader(r io.Reader, maxLine int) *EventReader {
	if maxLine <= 0 {
		maxLine = DefaultMaxLine
	}
	return &EventReader{br: bufio.NewReaderSize(r, min(maxLine, 64<<10)), maxLine: maxLine}
}

// Next returns the next event. At the end of the stream it returns io.EOF
// (after an Unterminated event if the stream stopped mid-event); a line or
// event over the bound returns ErrLineTooLong; any other read error is
// returned as it is, wrapped.
func (r *EventReader) Next() (Event, error) {
	if r.err != nil {
		return Event{}, r.err
	}
	r.raw.Reset()
	r.data.Reset()
	hasData := false
	for {
		line, err := r.readLine()
		if len(line) > 0 {
			if r.raw.Len()+len(line) > 4*r.maxLine {
				r.err = ErrLineTooLong
				return Event{}, r.err
			}
			r.raw.Write(line)
			content := bytes.TrimRight(line, "\r\n")
			if len(content) == 0 && err == nil {
				if r.raw.Len() == len(line) {
					r.raw.Reset() // a blank line between events: nothing to report
					continue
				}
				return r.event(hasData, false), nil
			}
			if d, ok := bytes.CutPrefix(content, []byte("data:")); ok {
				if hasData {
					r.data.WriteByte('\n')
				}
				r.data.Write(bytes.TrimPrefix(d, []byte(" ")))
				hasData = true
			}
		}
		if err != nil {
			r.err = err
			if errors.Is(err, io.EOF) && r.raw.Len() > 0 {
				return r.event(hasData, true), nil
			}
			return Event{}, err
		}
	}
}

func (r *EventReader) event(hasData, unterminated bool) Event {
	return Event{Raw: r.raw.Bytes(), Data: r.data.Bytes(), HasData: hasData, Unterminated: unterminated}
}

// readLine reads one line with its end of line, at most maxLine bytes.
func (r *EventReader) readLine() ([]byte, error) {
	line, err := r.br.ReadSlice('\n')
	if !errors.Is(err, bufio.ErrBufferFull) {
		if err != nil && !errors.Is(err, io.EOF) {
			err = fmt.Errorf("reading the stream: %w", err)
		}
		return line, err
	}
	long := append([]byte(nil), line...)
	for errors.Is(err, bufio.ErrBufferFull) {
		if len(long) > r.maxLine {
			return nil, ErrLineTooLong
		}
		line, err = r.br.ReadSlice('\n')
		long = append(long, line...)
	}
	if len(long) > r.maxLine {
		return nil, ErrLineTooLong
	}
	if err != nil && !errors.Is(err, io.EOF) {
		err = fmt.Errorf("reading the stream: %w", err)
	}
	return long, err
}
