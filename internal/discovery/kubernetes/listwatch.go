package kubernetes

import (
	"context"
	"fmt"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/discovery"
)

// The list-then-watch of client-go's reflector, for one resource and
// without its cache: LIST the slices (their state, and the collection's
// resourceVersion), then WATCH from that resourceVersion, applying each
// event to the slices seen and giving the replicas whenever they change.
// A watch the server ends cleanly (its timeout) resumes from the last
// resourceVersion seen; a watch that fails, or whose resourceVersion the
// server no longer has (410 Gone: "too old resource version"), is
// followed by a fresh LIST, which replaces the slices seen, so nothing
// missed in between is lost. While the API server cannot be read the last
// list stays: replicas are never dropped for the source's own failure.
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

// Run lists and watches until ctx ends; the first list is given as soon
// as it is read, then one after each change.
func (k *Source) Run(ctx context.Context, update func([]discovery.Replica)) {
	v := &view{k: k, update: update}
	var rv string
	relist, delay := true, time.Duration(0)
	for {
		var err error
		progressed := false
		if relist {
			rv, err = k.list(ctx, v)
		}
		if err == nil {
			rv, progressed, err = k.follow(ctx, v, rv)
		}
		if ctx.Err() != nil {
			return
		}
		relist = err != nil
		if progressed {
			delay = 0
		}
		if !clock.Sleep(k.cfg.Clock, delay, ctx.Done()) {
			return
		}
		delay = min(max(2*delay, minBackoff), maxBackoff)
	}
}

// list reads the slices, replaces the view's with them and gives their
// replicas; it returns the collection's resourceVersion to watch from.
func (k *Source) list(ctx context.Context, v *view) (string, error) {
	lctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	l, err := k.client.List(lctx, metav1.ListOptions{LabelSelector: k.sel.String()})
	if err != nil {
		k.failed(ctx, "cannot list EndpointSlices", err)
		return "", err
	}
	if k.failing {
		k.cfg.Log.Info("kubernetes discovery: the EndpointSlices are read again", "source", k.Name(), "slices", len(l.Items))
		k.failing = false
	}
	v.slices = make(map[string]*discoveryv1.EndpointSlice, len(l.Items))
	for i := range l.Items {
		s := &l.Items[i]
		if k.sel.Matches(labels.Set(s.Labels)) {
			v.slices[s.Name] = s
		}
	}
	v.give()
	return l.ResourceVersion, nil
}

// follow watches from rv until the watch ends: it returns the last
// resourceVersion seen, whether any event came, and why the watch ended
// (nil: the server closed it cleanly; it may be resumed from rv).
func (k *Source) follow(ctx context.Context, v *view, rv string) (string, bool, error) {
	timeout := int64(watchTimeout / time.Second)
	w, err := k.client.Watch(ctx, metav1.ListOptions{LabelSelector: k.sel.String(), ResourceVersion: rv,
		AllowWatchBookmarks: true, TimeoutSeconds: &timeout})
	if err != nil {
		k.failed(ctx, "cannot watch EndpointSlices", err)
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
		if err := k.apply(v, ev); err != nil {
			if gone(err) {
				k.cfg.Log.Debug("kubernetes discovery: the watch's resourceVersion expired; listing again", "source", k.Name())
			} else {
				k.failed(ctx, "the watch failed", err)
			}
			return rv, progressed, err
		}
		progressed = true
		if s, ok := ev.Object.(*discoveryv1.EndpointSlice); ok && s.ResourceVersion != "" {
			rv = s.ResourceVersion
		}
	}
}

// apply applies one watch event to the view (and gives the replicas when
// they changed); an error event is returned as the API's error.
func (k *Source) apply(v *view, ev watch.Event) error {
	if ev.Type == watch.Error {
		return apierrors.FromObject(ev.Object)
	}
	s, ok := ev.Object.(*discoveryv1.EndpointSlice)
	if !ok {
		return fmt.Errorf("kubernetes discovery: a watch event of %T, not an EndpointSlice", ev.Object)
	}
	switch ev.Type {
	case watch.Added, watch.Modified:
		if k.sel.Matches(labels.Set(s.Labels)) {
			v.slices[s.Name] = s
		} else { // relabelled out of the selector
			delete(v.slices, s.Name)
		}
	case watch.Deleted:
		delete(v.slices, s.Name)
	default: // a bookmark: a newer resourceVersion, nothing changed
		return nil
	}
	v.give()
	return nil
}

// gone reports a resourceVersion the server no longer has (410): the
// usual end of a long watch, answered by a fresh list.
func gone(err error) bool { return apierrors.IsResourceExpired(err) || apierrors.IsGone(err) }

// failed logs a failure to read the API server, once per streak of
// failures (the first), unless ctx ended.
func (k *Source) failed(ctx context.Context, what string, err error) {
	if ctx.Err() != nil || k.failing {
		return
	}
	k.failing = true
	k.cfg.Log.Warn("kubernetes discovery: "+what+"; keeping the previous replica list", "source", k.Name(), "err", err)
}
