package kubernetes

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/kvgate/kvgate/internal/clock"
)

// The list-then-watch of client-go's reflector, for one resource and
// without its cache: LIST the objects (their state, and the collection's
// resourceVersion), then WATCH from that resourceVersion, applying each
// event to the objects seen. A watch the server ends cleanly (its
// timeout) resumes from the last resourceVersion seen; a watch that
// fails, or whose resourceVersion the server no longer has (410 Gone:
// "too old resource version"), is followed by a fresh LIST, which
// replaces the objects seen, so nothing missed in between is lost. While
// the API server cannot be read the last list stays: replicas are never
// dropped for the source's own failure.
//
// Each new cycle (a watch resumed, or a list) waits on the injected
// clock: not at all after a watch that delivered events (it did its
// work), nor the first time; then each time twice as long as the last,
// from minBackoff to maxBackoff (capped exponential backoff), so that a
// list or a watch that keeps failing, or watches that end at once, are
// retried ever more slowly, never in a tight loop.
const (
	minBackoff = time.Second
	maxBackoff = 30 * time.Second
	// watchTimeout asks the server to end each watch (cleanly) after this
	// long, so that a connection silently gone is replaced in time.
	watchTimeout = 5 * time.Minute
	// listTimeout bounds one LIST (the client has no timeout of its own).
	listTimeout = 30 * time.Second
)

// object is what a reflector follows: a typed API object (a pointer) or
// an unstructured one.
type object interface {
	runtime.Object
	metav1.Object
}

// store receives what a reflector reads: the whole collection after each
// list, then each change.
type store[T object] interface {
	replace(items []T)
	apply(t watch.EventType, o T)
}

// reflector list-watches one resource (kind, for logs: "EndpointSlices")
// with the selectors of opts, into a store.
type reflector[T object] struct {
	kind, source string
	list         func(ctx context.Context, opts metav1.ListOptions) ([]T, string, error)
	watch        func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
	opts         metav1.ListOptions
	clock        clock.Clock
	log          *slog.Logger
	failing      bool // the last list or watch failed (logged once per streak)
}

// run lists and watches until ctx ends.
func (r *reflector[T]) run(ctx context.Context, s store[T]) {
	var rv string
	relist, delay := true, time.Duration(0)
	for {
		var err error
		progressed := false
		if relist {
			rv, err = r.relist(ctx, s)
		}
		if err == nil {
			rv, progressed, err = r.follow(ctx, s, rv)
		}
		if ctx.Err() != nil {
			return
		}
		relist = err != nil
		if progressed {
			delay = 0
		}
		if !clock.Sleep(r.clock, delay, ctx.Done()) {
			return
		}
		delay = min(max(2*delay, minBackoff), maxBackoff)
	}
}

// relist reads the objects and replaces the store's with them; it returns
// the collection's resourceVersion to watch from.
func (r *reflector[T]) relist(ctx context.Context, s store[T]) (string, error) {
	lctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	items, rv, err := r.list(lctx, r.opts)
	if err != nil {
		r.failed(ctx, "cannot list "+r.kind, err)
		return "", err
	}
	if r.failing {
		r.log.Info("kubernetes discovery: the "+r.kind+" are read again", "source", r.source, "objects", len(items))
		r.failing = false
	}
	s.replace(items)
	return rv, nil
}

// follow watches from rv until the watch ends: it returns the last
// resourceVersion seen, whether any event came, and why the watch ended
// (nil: the server closed it cleanly; it may be resumed from rv).
func (r *reflector[T]) follow(ctx context.Context, s store[T], rv string) (string, bool, error) {
	timeout := int64(watchTimeout / time.Second)
	opts := r.opts
	opts.ResourceVersion, opts.AllowWatchBookmarks, opts.TimeoutSeconds = rv, true, &timeout
	w, err := r.watch(ctx, opts)
	if err != nil {
		r.failed(ctx, "cannot watch "+r.kind, err)
		return rv, false, err
	}
	defer w.Stop()
	progressed := false
	for {
		var ev watch.Event
		var open bool
		select {
		case <-ctx.Done():
			return rv, progressed, ctx.Err()
		case ev, open = <-w.ResultChan():
		}
		if !open {
			return rv, progressed, nil
		}
		o, err := r.event(ev)
		if err != nil {
			if gone(err) {
				r.log.Debug("kubernetes discovery: the watch's resourceVersion expired; listing again", "source", r.source)
			} else {
				r.failed(ctx, "the watch of "+r.kind+" failed", err)
			}
			return rv, progressed, err
		}
		progressed = true
		if ev.Type != watch.Bookmark { // a bookmark: a newer resourceVersion, nothing changed
			s.apply(ev.Type, o)
		}
		if v := o.GetResourceVersion(); v != "" {
			rv = v
		}
	}
}

// event is a watch event's object; an error event is returned as the
// API's error.
func (r *reflector[T]) event(ev watch.Event) (T, error) {
	var zero T
	if ev.Type == watch.Error {
		return zero, apierrors.FromObject(ev.Object)
	}
	o, ok := ev.Object.(T)
	if !ok {
		return zero, fmt.Errorf("kubernetes discovery: a watch event of %T among the %s", ev.Object, r.kind)
	}
	return o, nil
}

// gone reports a resourceVersion the server no longer has (410): the
// usual end of a long watch, answered by a fresh list.
func gone(err error) bool { return apierrors.IsResourceExpired(err) || apierrors.IsGone(err) }

// failed logs a failure to read the API server, once per streak of
// failures (the first), unless ctx ended.
func (r *reflector[T]) failed(ctx context.Context, what string, err error) {
	if ctx.Err() != nil || r.failing {
		return
	}
	r.failing = true
	r.log.Warn("kubernetes discovery: "+what+"; keeping the previous replica list", "source", r.source, "err", err)
}
