package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrFrames: a message that is not [topic, 8-byte seq, payload].
var ErrFrames = errors.New("kvevents: bad message frames")

// SeqFrame is the 8-byte big-endian sequence frame of a message.
func SeqFrame(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// EncodeFrames builds the three frames vLLM sends for one batch.
func EncodeFrames(topic string, seq uint64, b Batch, f Form) ([][]byte, error) {
	payload, err := Encode(b, f)
	if err != nil {
		return nil, err
	}
	return [][]byte{[]byte(topic), SeqFrame(seq), payload}, nil
}

// DecodeFrames parses the frames of one received message.
func DecodeFrames(frames [][]byte) (Message, error) {
	topic, seq, payload, err := SplitFrames(frames)
	if err != nil {
		return Message{}, err
	}
	b, err := Decode(payload)
	if err != nil {
		return Message{Topic: topic, Seq: seq}, err
	}
	return Message{Topic: topic, Seq: seq, Batch: b}, nil
}

// SplitFrames checks a message's frames and returns them undecoded, so that
// a receiver can judge the topic (and count the sequence) before it pays
// for decoding the payload.
func SplitFrames(frames [][]byte) (topic string, seq uint64, payload []byte, err error) {
	if len(frames) != 3 {
		return "", 0, nil, fmt.Errorf("%w: %d frames, want [topic, seq, payload]", ErrFrames, len(frames))
	}
	if len(frames[1]) != 8 {
		return "", 0, nil, fmt.Errorf("%w: sequence frame of %d bytes, want 8", ErrFrames, len(frames[1]))
	}
	return string(frames[0]), binary.BigEndian.Uint64(frames[1]), frames[2], nil
}
